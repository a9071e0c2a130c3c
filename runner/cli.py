"""The `runner` command line: thin commands over the core. The only place errors become messages."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

from runner import __version__
from runner.errors import RunnerError


def reports_errors(fn):
    """Turn the runner's own errors into one `Error: ...` line and the error's exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RunnerError as exc:
            click.echo(f"Error: {_one_line(str(exc))}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("Error: interrupted; finished rows are stored, rerun to resume", err=True)
            sys.exit(130)

    return wrapper


def _one_line(message: str, limit: int = 800) -> str:
    """Messages from libraries (vLLM, pydantic) can span many lines; an error is one line."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _table(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _fmt(v, digits: int = 2, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    return f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}"


def _speculation(choice_json) -> str:
    """How the run chose its speculative decoding, from run_stats.engine_choice_json."""
    import json

    cal = (json.loads(choice_json) if choice_json else {}).get("speculative_calibration")
    if not cal:
        return "as configured"
    k = cal.get("chosen_draft_tokens", 0)
    what = f"{k} draft tokens" if k else "off"
    if "reused_calibration_id" in cal:
        return f"{what} (calibration #{cal['reused_calibration_id']} of {cal['measured_at_utc'][:10]}, reused)"
    if "calibration_id" in cal:
        return f"{what} (measured in {cal.get('calibration_s', 0):.1f} s, stored as calibration #{cal['calibration_id']})"
    return f"{what} ({cal.get('skipped', 'not measured')})"


def _open_store(job, db):
    """The results database named by --job or --db, and the job's name when --job was given."""
    from runner.errors import SpecError, StoreError
    from runner.store import Store

    job_name = None
    if job:
        from runner.spec import load_job

        spec = load_job(job)
        db, job_name = spec.database_path, spec.name
    if not db:
        raise SpecError("give --job JOB or --db DATABASE")
    if not Path(db).is_file():
        raise StoreError(f"{db}: no results database here yet")
    return Store(db), job_name


_db_options = [
    click.option("--job", "job", type=click.Path(dir_okay=False), help="Job file whose database to read."),
    click.option("--db", "db", type=click.Path(dir_okay=False), help="Results database to read."),
]


def db_options(fn):
    for option in reversed(_db_options):
        fn = option(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="runner")
def cli():
    """Offline batch LLM extraction over Parquet documents, with vLLM, into SQLite.

    \b
    Example:
      runner validate jobs/summarize.yaml
      runner plan jobs/summarize.yaml
      runner run jobs/summarize.yaml
      runner stats --job jobs/summarize.yaml
    """


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--restart", is_flag=True, help="Delete this job's stored results and start over.")
@click.option("--wait", is_flag=True, help="If the job is already running, wait for it instead of exiting.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary (for cron); errors still print.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default=None,
              help="Where engines run: this process (local) or replicas on a Ray cluster (ray). Default: the job's.")
@click.option("--recalibrate", is_flag=True,
              help="speculative: auto: measure again instead of reusing the choice stored for this job's settings.")
@click.option("--engine", type=click.Choice(["vllm", "fake"]), default="vllm", hidden=True,
              help="Test seam: the fake engine exercises the runner without generating.")
@reports_errors
def run(job, restart, wait, quiet, executor, recalibrate, engine):
    """Run JOB: generate an extraction for every input row and store it in SQLite.

    Resumes by default: rows already stored for the job are skipped.

    \b
    Example:
      runner run jobs/summarize.yaml
      runner run --quiet jobs/summarize.yaml    # from cron
      runner run --executor ray jobs/summarize.yaml   # replicas on a Ray cluster (RAY_ADDRESS)
    """
    from runner.engines import build_engine
    from runner.run import run_job
    from runner.spec import load_job

    from runner.engines import preload

    spec = load_job(job).with_executor(executor)
    progress = None
    if not quiet:
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        progress = functools.partial(tqdm, desc=spec.name, unit="doc", file=sys.stderr, dynamic_ncols=True,
                                     mininterval=0.5 if tty else 30.0, smoothing=0.1)
    summary = run_job(spec, engine_factory=lambda j: build_engine(j, engine), restart=restart, wait=wait,
                      progress_factory=(lambda total: progress(total=total)) if progress else None,
                      recalibrate=recalibrate,
                      # Ray imports vLLM in its replicas, not here
                      on_input_ok=(lambda: preload(spec, engine)) if spec.spec.executor == "local" else None)
    if not quiet:
        _print_run_summary(summary)
    _finished_run["executor"] = spec.spec.executor


_finished_run: dict = {}  # set when `runner run` completed: main() may then exit at once


def _exit_now(executor: str) -> None:
    """Leave without the interpreter tearing torch, CUDA and vLLM down module by module (seconds
    on a GPU machine, on the user's wall clock). Safe after a completed run: the results database
    is closed, the engine shut down, and the kernel releases the job's lock."""
    if executor == "ray":  # a local Ray cluster is stopped by ray.shutdown, not by the kernel
        import ray

        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _print_run_summary(summary) -> None:
    s = summary.stats
    click.echo(f"Results: {summary.database} (run {summary.run_id})")
    click.echo(_table([
        ("rows", f"{s['rows_total']:,} run, {summary.rows_skipped:,} already done, {summary.rows_input:,} in input"),
        ("status", ", ".join(f"{k} {v}" for k, v in summary.counts.items() if v) or "-"),
        ("documents/s", _fmt(s["documents_per_s"])),
        ("output tok/s", _fmt(s["output_tokens_per_s"], 1)),
        ("prefix-cache hit rate", f"{_fmt(s['prefix_cache_hit_rate'], pct=True)} (plan bound {_fmt(s['plan_prefix_share'], pct=True)})"),
        ("spec. acceptance", _fmt(s["spec_acceptance_rate"], pct=True)),
        ("speculation", _speculation(s.get("engine_choice_json"))),
        ("wall / generation", f"{s['wall_s']:.1f} s / {s['generation_s']:.1f} s"),
    ]))


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@reports_errors
def validate(job):
    """Check JOB without running it: the YAML, engine config, schema, input and model folder.

    \b
    Example:
      runner validate jobs/summarize.yaml
    """
    from runner.inputs import scan_input
    from runner.models import is_model_dir
    from runner.spec import load_job

    spec = load_job(job)
    scan = scan_input(spec.input_path, spec.spec.input)
    model = "ready" if is_model_dir(spec.model_path, weights=spec.engine.needs_weights) else "MISSING (runner prepare-model)"
    click.echo(f"OK: {job}")
    click.echo(_table([
        ("input", f"{scan.rows:,} rows in {len(scan.files)} file(s)"),
        ("schema", str(spec.schema_path)),
        ("engine config", str(spec.engine_config_path)),
        ("model", f"{spec.model_path} [{model}]"),
        ("database", str(spec.database_path)),
    ]))


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@reports_errors
def plan(job):
    """Show how JOB's rows group by system prompt, and the prefix-cache bound.

    The share of prompt tokens that are a shared prefix, counted in whole KV blocks as vLLM
    caches them, bounds the prefix-cache hit rate a run can reach.

    \b
    Example:
      runner plan jobs/summarize.yaml
    """
    from runner.errors import ModelError
    from runner.inputs import iter_documents, scan_input
    from runner.plan import summarize_plan
    from runner.prompting import PromptBuilder
    from runner.spec import load_job

    spec = load_job(job)
    scan_input(spec.input_path, spec.spec.input)
    try:
        builder = PromptBuilder(spec.model_path, spec.spec.prompts.user_template)
    except ModelError:
        builder = None
    docs = iter_documents(spec.input_path, spec.spec.input, spec.system_prompt)
    p = summarize_plan(docs, builder, spec.block_tokens)
    click.echo(f"{'group':<12}  {'rows':>7}  {'prompt tok':>11}  {'system tok':>10}  {'cacheable':>9}  system prompt")
    for g in p.groups:
        share = g.cacheable_tokens / g.prompt_tokens if g.prompt_tokens else 0
        click.echo(f"{g.key:<12}  {g.rows:>7,}  {g.prompt_tokens:>11,}  {g.prefix_tokens:>10,}  {share:>9.1%}  {g.preview}")
    exact = "" if p.tokens_exact else " (estimated: model not prepared)"
    click.echo(f"{len(p.groups)} groups, {p.rows:,} rows, {p.prompt_tokens:,} prompt tokens{exact}")
    click.echo(f"shared-prefix share of prompt tokens (prefix-cache bound, {p.block_tokens}-token blocks): "
               f"{100 * p.prefix_share:.1f}%")


@cli.command()
@click.argument("run_id", required=False, type=int)
@db_options
@click.option("--last", "last", default=1, show_default=True, help="How many recent runs to show.")
@reports_errors
def stats(run_id, job, db, last):
    """Show the stats of run RUN_ID, or of the last runs of a job.

    \b
    Example:
      runner stats --job jobs/summarize.yaml --last 5
      runner stats 3 --db out/summarize.sqlite
    """
    from runner.errors import StoreError

    store, job_name = _open_store(job, db)
    runs = [store.run(run_id)] if run_id is not None else store.latest_runs(job_name, last)
    if not runs or runs[0] is None:
        raise StoreError(f"{store.path}: no run {run_id}" if run_id is not None else f"{store.path}: no runs yet")
    for r in runs:
        s = store.stats(r["id"]) or {}
        counts = store.result_counts(r["id"])
        click.echo(f"run {r['id']}  {r['job_name']}  {r['status']}  started {r['started_at_utc']}")
        click.echo(_table([
            ("rows by status", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"),
            ("documents/s", _fmt(s.get("documents_per_s"))),
            ("output / total tok/s", f"{_fmt(s.get('output_tokens_per_s'), 1)} / {_fmt(s.get('total_tokens_per_s'), 1)}"),
            ("prefix-cache hit rate", f"{_fmt(s.get('prefix_cache_hit_rate'), pct=True)} (plan bound {_fmt(s.get('plan_prefix_share'), pct=True)})"),
            ("spec. acceptance", _fmt(s.get("spec_acceptance_rate"), pct=True)),
            ("speculation", _speculation(s.get("engine_choice_json"))),
            ("wall / generation s", f"{_fmt(s.get('wall_s'), 1)} / {_fmt(s.get('generation_s'), 1)}"),
            ("engine", f"{r['engine_backend'] or '-'} {r['engine_version'] or ''} {r['engine_settings_json'] or ''}"),
        ] + ([("error", r["error"])] if r["error"] else [])))


@cli.command()
@click.argument("run_id", type=int)
@db_options
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False), help="HTML file to write.")
@reports_errors
def report(run_id, job, db, output):
    """Write an HTML report of run RUN_ID: throughput over time, per-group cache hits, statuses, tokens.

    The file is self-contained (plots are inline SVG) and opens in any browser.

    \b
    Example:
      runner report 3 --job jobs/summarize.yaml -o report.html
    """
    from runner.report import render_report

    store, _ = _open_store(job, db)
    Path(output).write_text(render_report(store, run_id), encoding="utf-8")
    click.echo(f"Report: {output}")


@cli.command()
@click.argument("run_id", type=int)
@db_options
@click.option("--format", "fmt", type=click.Choice(["parquet", "csv", "jsonl"]), required=True)
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False), help="File to write.")
@reports_errors
def export(run_id, job, db, fmt, output):
    """Export run RUN_ID's results, with the extraction's top-level fields as columns.

    Scalar fields become columns named extraction_FIELD; arrays and objects become JSON text in
    extraction_FIELD_json.

    \b
    Example:
      runner export 3 --job jobs/summarize.yaml --format parquet -o results.parquet
    """
    from runner.export import export_run

    store, _ = _open_store(job, db)
    n = export_run(store, run_id, fmt, Path(output))
    click.echo(f"Exported {n:,} rows to {output}")


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--wait", is_flag=True, help="If the job is running, wait for it instead of exiting.")
@click.option("--engine", type=click.Choice(["vllm", "fake"]), default="vllm", hidden=True)
@reports_errors
def calibrate(job, wait, engine):
    """Measure JOB's speculative decoding on its own rows and store the choice.

    For engine configs with `speculative: auto`. Runs slices of the job's rows without drafts and
    with ngram drafts, keeps the faster setting, and stores it in the job's database: later runs
    with the same model, engine settings, vLLM version, device, schema, sampling and prompts start
    one engine with it. Results of the slices are not stored.

    \b
    Example:
      runner calibrate jobs/summarize.yaml
    """
    from runner.engines import build_engine
    from runner.errors import SpecError
    from runner.run import calibrate_job
    from runner.spec import load_job

    spec = load_job(job)
    if spec.engine.speculative != "auto":
        raise SpecError(f"{spec.engine_config_path}: speculative: calibrate needs `speculative: auto` "
                        f"(the job's engine config fixes it)")
    record = calibrate_job(spec, engine_factory=lambda j: build_engine(j, engine), wait=wait)
    if "calibration_id" in record:
        k = record["stored_draft_tokens"]
        click.echo(f"Speculation: {f'{k} draft tokens' if k else 'off'} (stored as calibration #{record['calibration_id']})")
    else:
        click.echo(f"Speculation: nothing stored ({record.get('skipped', 'not measured')})")
    rows = [(f"{p['draft_tokens_setting']} drafts", f"{p['rows']} rows, {p['output_tokens_per_s']:.1f} output tok/s"
             + (f", acceptance by position {p['acceptance_by_position']}" if p["acceptance_by_position"] else ""))
            for p in record.get("phases", [])]
    if rows:
        click.echo(_table(rows))


@cli.command("prepare-model")
@click.option("--force", is_flag=True, help="Convert again even if the folder exists.")
@reports_errors
def prepare_model(force):
    """Convert the embedded default model (SmolLM2-135M-Instruct GGUF) into the runner's cache, once.

    \b
    Example:
      runner prepare-model
    """
    from runner.models import prepare_builtin_model

    path, converted = prepare_builtin_model(force=force)
    click.echo(f"{'Converted' if converted else 'Already prepared'}: {path}")


def main():  # console-script entry point; the guard matters for vLLM's spawned workers
    try:
        cli()
    except SystemExit as exc:
        if exc.code in (0, None) and _finished_run:
            _exit_now(_finished_run["executor"])
        raise


if __name__ == "__main__":
    main()
