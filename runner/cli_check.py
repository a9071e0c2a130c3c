"""Commands that check a job without running it: validate (the job, its files, input, model and
database place) and plan (groups, token counts, the prefix-cache bound, rows too long)."""
from __future__ import annotations

import click

from runner.cli import cli, job_settings, reports_errors
from runner.cli_output import check_stdout, say, table


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@job_settings
@reports_errors
def validate(job, overrides):
    """Check JOB without running it: the YAML, engine config, schema, input and model folder.

    \b
    Example:
      runner validate jobs/summarize.yaml
    """
    from runner.errors import ModelError
    from runner.models import is_model_dir, missing_model
    from runner.readers import LocalReader
    from runner.spec import load_job
    from runner.store_paths import refuse_unwritable
    from runner.store_sqlite import check_database
    from runner.summary import plural

    spec = load_job(job, overrides)
    reader = LocalReader(spec.input_path, spec.spec.input)
    scan = reader.scan()
    _check_prompt(spec, reader, scan)  # the tokenizer: needed here whatever the executor
    ready = is_model_dir(spec.model_path, weights=spec.engine.needs_weights)
    if not ready and spec.spec.executor == "local":  # `runner run` would stop there: so does this
        raise ModelError(missing_model(spec.model_path))
    refuse_unwritable(spec.database_path, spec.name)
    check_database(spec.database_path)
    say(f"OK: {job}")
    say(table([
        ("input", f"{plural(scan.rows, 'row')} in {plural(len(scan.files), 'file')}"
                  + (f"; {len(scan.skip):,} left out (null or repeated ids)" if scan.skip else "")),
        ("schema", str(spec.schema_path)),
        ("engine config", str(spec.engine_config_path)),
        ("model", f"{spec.model_path} [{'ready' if ready else 'weights not here: the Ray replicas load them'}]"),
        ("database", str(spec.database_path)),
    ]))


def _check_prompt(spec, reader, scan) -> None:
    """Build the first row's prompt: a missing tokenizer, or a chat template that does not compile
    or render, stops `validate` here, not a night's run."""
    from runner.prompting import builder_for, check_first_prompt

    note = check_first_prompt(spec, builder_for(spec), reader.documents(spec.system_source, scan.skip))
    if note:
        from runner.cli_output import warn

        warn(f"Note: {note}")


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@job_settings
@reports_errors
def plan(job, overrides):
    """Show how JOB's rows group by system prompt, and the prefix-cache bound.

    The share of prompt tokens that are a shared prefix, counted in whole KV blocks as vLLM
    caches them, bounds the prefix-cache hit rate a run can reach. Rows whose prompt, with
    sampling.max_tokens, is longer than max_model_len are counted too (a run stores them failed,
    or cuts them with input.on_too_long: truncate).

    \b
    Example:
      runner plan jobs/summarize.yaml
    """
    from runner.errors import ModelError
    from runner.plan import CharEstimate, summarize_plan
    from runner.summary import plural
    from runner.prompting import builder_for, check_first_prompt
    from runner.readers import LocalReader
    from runner.spec import load_job

    check_stdout()  # the plan is the output: closed (`>&-`), an error, not exit 0 having said nothing
    spec = load_job(job, overrides)
    reader = LocalReader(spec.input_path, spec.spec.input)
    scan = reader.scan()
    try:
        builder = builder_for(spec)
    except ModelError:
        from runner.models import builtin_model_dir

        if spec.model_path.parent != builtin_model_dir().parent:  # a mistyped folder: as validate and run say
            raise
        # the builtin model, not prepared yet: estimated from the characters
        builder = CharEstimate(spec.spec.prompts.user_template, [e.model_dump() for e in spec.spec.prompts.examples])
    else:
        check_first_prompt(spec, builder, reader.documents(spec.system_source, scan.skip))  # as validate and run
    mml, max_tokens = spec.engine.max_model_len, spec.spec.sampling.max_tokens
    # whether a cut of the document makes a too-long row fit: as a run decides it (the template's tokens too)
    fits = None if isinstance(builder, CharEstimate) else (
        lambda system, doc, ids: builder.fit(system, doc, ids, mml, max_tokens, True)[1] is None)
    p = summarize_plan(reader.documents(spec.system_source, scan.skip), builder, spec.block_tokens,
                       prompt_room=mml - max_tokens, fits=fits)
    say(f"{'group':<12}  {'rows':>7}  {'prompt tok':>11}  {'system tok':>10}  {'cacheable':>9}  system prompt")
    for g in p.groups:
        share = g.cacheable_tokens / g.prompt_tokens if g.prompt_tokens else 0
        say(f"{g.key:<12}  {g.rows:>7,}  {g.prompt_tokens:>11,}  {g.prefix_tokens:>10,}  {share:>9.1%}  {g.preview}")
    exact = "" if p.tokens_exact else " (estimated: model not prepared)"
    say(f"{plural(len(p.groups), 'group')}, {plural(p.rows, 'row')}, {plural(p.prompt_tokens, 'prompt token')}{exact}")
    _say_row_problems(spec, p, fits is not None)
    say(f"shared-prefix share of prompt tokens (prefix-cache bound, {p.block_tokens}-token blocks): "
        f"{'' if p.tokens_exact else '~'}{100 * p.prefix_share:.1f}%{exact}")


def _say_row_problems(spec, p, exact_fit: bool) -> None:
    """plan's lines on rows a run would store failed or cut; exact_fit: whether cuts were tried as a
    run tries them (the model's tokenizer), not estimated."""
    from runner.summary import plural

    if p.rows_bad_input and spec.spec.input.on_bad_row == "store":
        say(f"{plural(p.rows_bad_input, 'row')} with a null text or system prompt, or values prompts.system_template "
            "cannot take (input.on_bad_row: store: a run stores them as failed)")
    elif p.rows_bad_input:  # under `fail` a null stops the scan first: only the template's failures are left
        say(f"{plural(p.rows_bad_input, 'row')} with values prompts.system_template cannot take "
            "(a run stores them as failed)")
    if p.rows_without_prompt:
        say(f"{plural(p.rows_without_prompt, 'row')} whose values do not fit prompts.user_template (a run stores them as failed)")
    if p.rows_too_long:
        what = "cuts their documents to fit" if spec.spec.input.on_too_long == "truncate" else "stores them as failed"
        say(f"{'' if p.tokens_exact else '~'}{plural(p.rows_too_long, 'row')} with a prompt over "
            f"{p.prompt_room:,} tokens: with max_tokens {spec.spec.sampling.max_tokens:,} longer than max_model_len "
            f"{spec.engine.max_model_len:,} (input.on_too_long: {spec.spec.input.on_too_long}: a run {what})")
        # no cut of the document saves these: the prompt's other parts alone are over (estimated: the system prompt)
        beyond = p.rows_uncuttable if exact_fit else sum(g.rows for g in p.groups if g.prefix_tokens > p.prompt_room)
        if beyond:
            say(f"{'' if p.tokens_exact else '~'}{plural(beyond, 'row')} of them with a prompt over {p.prompt_room:,} "
                "tokens without the document (system prompt, few-shot turns, template): no cut of the document makes "
                "those fit (a run stores them as failed)")
