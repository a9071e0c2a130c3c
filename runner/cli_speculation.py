"""Commands about speculative decoding: calibrate, verify, distill."""
from __future__ import annotations

import click

from runner.cli import _engine_output, cli, job_settings, reports_errors
from runner.cli_output import say, table
from runner.summary import escaped


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@job_settings
@click.option("--wait", is_flag=True, help="If the job is running, wait for it instead of exiting.")
@click.option("--verbose", "-v", is_flag=True, help="vLLM's and torch's output to stderr instead of the job's log file.")
@click.option("--engine", type=click.Choice(["vllm", "fake"]), default="vllm", hidden=True)
@reports_errors
def calibrate(job, overrides, wait, verbose, engine):
    """Measure JOB's speculative decoding on its own rows and store the choice.

    For engine configs with `speculative: auto`. Runs slices of the job's rows without drafts and
    with ngram drafts, keeps the faster setting, and stores it in the job's database: later runs
    with the same model, engine settings, vLLM version, device, schema, sampling and prompts start
    one engine with it. Results of the slices are not stored. It measures whatever is stored (as
    run --recalibrate does).

    \b
    Example:
      runner calibrate nightly.yaml               # a job whose engine config says speculative: auto
      runner calibrate --set engine.speculative=auto jobs/summarize.yaml
    """
    from runner.engines import build_engine
    from runner.errors import SpecError
    from runner.calibration_run import calibrate_job
    from runner.spec import load_job

    spec = load_job(job, overrides)
    if spec.engine.speculative != "auto":
        raise SpecError(f"{spec.engine_config_path}: speculative: calibrate needs `speculative: auto` "
                        f"(the job's engine config fixes it; --set engine.speculative=auto measures anyway)")
    _, redirect = _engine_output(spec, verbose, "calibrate")
    with redirect:
        record = calibrate_job(spec, engine_factory=lambda j: build_engine(j, engine), wait=wait, backend=engine)
    if "calibration_id" in record:
        k = record["stored_draft_tokens"]
        say(f"Speculation: {f'{k} draft tokens' if k else 'off'} (stored as calibration #{record['calibration_id']})")
    else:
        say(f"Speculation: nothing stored ({record.get('skipped', 'not measured')})")
    rows = [(f"{p['draft_tokens_setting']} drafts", f"{p['rows']} rows, {p['output_tokens_per_s']:.1f} output tok/s"
             + (f", acceptance by position {p['acceptance_by_position']}" if p["acceptance_by_position"] else ""))
            for p in record.get("phases", [])]
    if rows:
        say(table(rows))


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--rows", type=click.IntRange(min=1), default=None, help="Rows to compare (default: engine.verify.rows, 64).")
@click.option("--wait", is_flag=True, help="If the job is running, wait for it instead of exiting.")
@click.option("--verbose", "-v", is_flag=True, help="vLLM's and torch's output to stderr instead of the job's log file.")
@click.option("--baseline", is_flag=True,
              help="Also run the rows twice without drafts: a setting that changes no more outputs than the engine "
                   "changes on its own (bf16 on a GPU varies with the batch) passes.")
@click.option("--engine", type=click.Choice(["vllm", "fake"]), default="vllm", hidden=True)
@job_settings
@reports_errors
def verify(job, rows, wait, verbose, baseline, engine, overrides):
    """Check whether JOB's speculative setting changes its greedy outputs, and store the answer.

    Runs the first rows of the job greedy, without drafts and with the job's speculative setting
    (with `speculative: auto`, each candidate), and compares the extractions: the share of rows
    that came out the same, the agreement per field, and the rows that differ. Runs do not use a
    setting that agreed on fewer rows than engine.verify.min_agreement (0.99), unless run --no-verify,
    until a later verify passes over as many rows with the failure's settings or the run's own
    (scheduling and sampling included).

    \b
    Example:
      runner verify jobs/summarize.yaml --rows 32
      runner verify --baseline jobs/gpu-job.yaml
    """
    from runner.engines import build_engine
    from runner.spec import load_job
    from runner.engines.speculation import Baseline, passes
    from runner.verify import verify_job

    spec = load_job(job, overrides)
    _, redirect = _engine_output(spec, verbose, "verify")
    with redirect:
        results = verify_job(spec, rows=rows, engine_factory=lambda j: build_engine(j, engine), wait=wait,
                             baseline=baseline, backend=engine)
    if not results:
        say("Nothing to verify: the job's engine config uses no speculative decoding")
    limit = spec.engine.verify.min_agreement
    if results and baseline:
        say(f"without drafts, twice: {results[0].baseline_agreement:.1%} of rows unchanged (the engine's own variation)")
    for v in results:
        verdict = "passes" if passes(v.agreement, limit, Baseline.of(v)) else \
            f"FAILS engine.verify.min_agreement {limit:.0%}: runs will not use it"
        if v.baseline_agreement is not None and v.agreement < limit:
            verdict += (f" (rows only the drafts changed: {v.rows_changed_by_drafts_only}, only the engine: "
                        f"{v.rows_changed_by_engine_only}; a sign test tells them apart, more --rows sharpen it)")
        say(f"{v.setting} (k={v.draft_tokens}): {v.agreement:.1%} of {v.rows} rows unchanged; {verdict} "
            f"(stored as verification #{v.verification_id})")
        say(table([(f"field {f}", f"{a:.1%} agree") for f, a in v.field_agreement.items()] or [("fields", "-")]))
        for d in v.differences[:5]:
            # model output (and an input's row id): escaped, as it may hold a terminal's escape sequences
            shown = [escaped(str(d[k]), backslashes=True) for k in ("row_id", "without", "with")]
            say(f"  {shown[0]}:\n    without drafts: {shown[1]}\n    with drafts:    {shown[2]}")


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Folder to write the draft model to.")
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True, help="Layers of the job's model the draft keeps.")
@click.option("--epochs", type=click.IntRange(min=1), default=2, show_default=True, help="Passes over the training rows.")
@click.option("--holdout", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.2, show_default=True, help="Share of rows held back to measure acceptance.")
@click.option("--max-rows", type=click.IntRange(min=1), default=None, help="Train on at most this many ok rows.")
@click.option("--wait", is_flag=True, help="If the job is running, wait for it instead of exiting.")
@reports_errors
def distill(job, out, layers, epochs, holdout, max_rows, wait):
    """Train a small draft model for JOB's model on JOB's own stored outputs.

    The draft keeps the model's tokenizer, embeddings, head and first layers, fine-tuned to predict
    the outputs the model gave for the job's ok rows. Rows held back measure how often its guesses
    would be accepted. Use it with calibration.candidates: [{method: draft_model, model: distilled}].

    \b
    Example:
      runner distill jobs/summarize.yaml --out drafts/summarize
    """
    import sys
    from pathlib import Path

    from tqdm import tqdm

    from runner.distill import DistillOptions, distill_job
    from runner.spec import load_job

    spec = load_job(job)
    opts = DistillOptions(layers=layers, epochs=epochs, holdout=holdout, max_rows=max_rows)
    from runner.console import BestEffort

    record = distill_job(spec, Path(out).resolve(), opts, wait=wait,  # a bar that cannot be written: training goes on
                         progress=lambda n: tqdm(total=n, desc="distill", unit="row", file=BestEffort(sys.stderr),
                                                 mininterval=1 if sys.stderr.isatty() else 30))
    say(f"Draft: {out} (recorded as draft #{record['draft_id']})")
    say(table([("trained on", f"{record['held_out_rows']} rows held out; loss by epoch {record['losses']}"),
               ("held-out acceptance by position", str(record["held_out_acceptance_by_position"])),
               ("training time", f"{record['train_s']:.0f} s")]))
