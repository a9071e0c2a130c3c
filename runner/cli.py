"""The `runner` command line: thin commands over the core. The only place errors become messages.

Commands that check a job without running it (validate, plan) live in runner/cli_check.py; those
that read results (stats, report, export) in runner/cli_results.py; status and prune in
runner/cli_stored.py.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys

import click

from runner import __version__
from runner.cli_output import reopen_closed, run_summary, say, stdout_open, warn
from runner.summary import one_line
from runner.process_clock import note_process_start, take_start
from runner.scratch import remove_scratch
from runner.errors import OutputClosed, RunnerError
from runner.signals import RUN_STOPPED, ignore_stop_signals, keep_ignoring_after_stop, sigterm_interrupts


def reports_errors(fn):
    """Turn the runner's own errors into one `Error: ...` line and the error's exit code."""

    # What a stop leaves: a run its finished rows; the other commands write whole files or nothing
    after = RUN_STOPPED if fn.__name__ == "run" else ""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with sigterm_interrupts(after):  # SIGTERM: one Error: line and exit 130, and a file half-written goes
                return fn(*args, **kwargs)
        except (OutputClosed, BrokenPipeError):  # `runner stats | head -1`: the reader stopped reading
            # Nothing more can go to standard output: point it at /dev/null so that the
            # interpreter's last flush does not fail too, and leave without a message.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(OutputClosed.exit_code)
        except RunnerError as exc:
            warn(f"Error: {one_line(str(exc))}")
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            warn("Error: interrupted" + (f"; {after}" if after else ""))
            sys.exit(130)

    return wrapper


_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


class _Commands(click.Group):
    """The command group; a usage error (a missing option, a bad value) is one `Error:` line, as
    every other error is, where click prints its usage, a hint and the error on 3-4 lines."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _NO_ARGS as exc:  # `runner` alone: the help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else "runner"
            warn(f"Error: {one_line(exc.format_message())} (see: {where} --help)")
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            warn("Aborted!")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)  # an int: the exit code of --help, --version


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="runner")
def cli():
    """Offline batch LLM extraction over documents (Parquet, JSON Lines, CSV, OpenAI batch files), with vLLM, into SQLite.

    \b
    Example:
      runner validate jobs/summarize.yaml
      runner plan jobs/summarize.yaml
      runner run jobs/summarize.yaml
      runner status jobs/summarize.yaml
      runner stats --job jobs/summarize.yaml
    """


def _engine_output(spec, verbose: bool, command: str):
    """vLLM's and torch's output: to the job's log file beside its database, or to stderr (-v)."""
    from runner.console import LOG_KEEP_BYTES, engine_output_to, log_path_for, rotate_if_large
    from runner.lock import held
    from runner.store_paths import refuse_unwritable, refuse_unwritable_beside

    db = spec.database_path
    if not (db.is_file() and os.access(db, os.W_OK)):  # where it goes: as validate says it, not as the log fails
        refuse_unwritable(db)  # (what a file there holds the store says, as in every command)
    refuse_unwritable_beside(db, spec.name)
    log = None if verbose else log_path_for(spec.database_path, spec.name)
    if log is not None and not held(db, spec.name):  # never the log a running job writes to
        rotate_if_large(log, LOG_KEEP_BYTES)
    return log, engine_output_to(log, header=f"runner {command} {spec.path} (pid {os.getpid()})")


def _progress(spec, quiet: bool):
    """The run's progress bar (None with --quiet): documents stored, on stderr."""
    if quiet:
        return None
    from runner.console import RunBar, console

    err = console().err
    tty = err.isatty() if hasattr(err, "isatty") else False
    return lambda total: RunBar(total, spec.name, err, mininterval=0.5 if tty else 30.0)


def job_settings(fn):
    """--set KEY=VALUE, repeatable: a job setting for this command only."""
    return click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                        help="Override a job setting for this command, e.g. --set engine.max_num_seqs=64 "
                             "(command line > job file > engine config > defaults). Repeatable.")(fn)


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@job_settings
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Run only the first N input rows (a smoke run); the rest are left for a later run.")
@click.option("--restart", is_flag=True,
              help="Run every row again: each stored result stays until its new one replaces it, then moves "
                   "to results_history, where stats, export and report of the run that made it still find it; "
                   "stopped midway, the next run goes on with the rest (a next --restart too, while rows "
                   "are still set aside).")
@click.option("--retry-failed", is_flag=True,
              help="Run the rows whose status is not ok again (with the job as it is now); ok rows stay, "
                   "except those a stopped --restart set aside.")
@click.option("--wait", is_flag=True, help="If the job is already running, wait for it instead of exiting.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing on success (for cron); errors still print.")
@click.option("--verbose", "-v", is_flag=True, help="vLLM's and torch's output to stderr instead of the job's log file.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default=None,
              help="Where engines run: this process (local) or replicas on a Ray cluster (ray). Default: the job's.")
@click.option("--recalibrate", is_flag=True,
              help="speculative: auto: measure again instead of reusing the choice stored for this job's settings.")
@click.option("--no-verify", is_flag=True,
              help="Use speculative settings even where `runner verify` found they change greedy outputs.")
@click.option("--engine", type=click.Choice(["vllm", "fake"]), default="vllm", hidden=True,
              help="Test seam: the fake engine exercises the runner without generating.")
@reports_errors
def run(job, overrides, limit, restart, retry_failed, wait, quiet, verbose, executor, recalibrate, no_verify, engine):
    """Run JOB: generate an extraction for every input row and store it in SQLite.

    Resumes by default: rows already stored by this version of the job are skipped; rows made by
    another version (changed schema, prompts, sampling, model) run again, the old results kept in
    results_history. vLLM's own output goes to DATABASE.JOB.log beside the results (-v: stderr).
    Exits 65 when more of the input's rows are not ok (or left out: input.on_bad_row) than
    output.max_failed_fraction allows; rows stored before but no longer in the input do not count.

    \b
    Example:
      runner run jobs/summarize.yaml
      runner run --quiet jobs/summarize.yaml    # from cron: prints nothing on success
      runner run --retry-failed jobs/summarize.yaml
      runner run --executor ray jobs/summarize.yaml   # replicas on a Ray cluster (RAY_ADDRESS)
      runner run --limit 20 --set engine.max_num_seqs=8 jobs/summarize.yaml   # a smoke run
    """
    from runner.engines import build_engine, preload
    from runner.errors import TooManyFailed
    from runner.run import run_job
    from runner.spec import load_job

    spec = load_job(job, overrides, executor=executor, limit=limit)
    log, redirect = _engine_output(spec, verbose, "run")
    with redirect:
        summary = run_job(
            spec, engine_factory=lambda j: build_engine(j, engine), restart=restart, wait=wait,
            progress_factory=_progress(spec, quiet), recalibrate=recalibrate, retry_failed=retry_failed,
            verify_gate=not no_verify, backend=engine,
            exits_after=True,  # main() ends the process once the run completed
            started=take_start(),  # the stored wall is the user's: from the process's start
            notify=None if quiet else (lambda msg: warn(f"Note: {msg}")), log_path=str(log) if log else None,
            # Ray imports vLLM in its replicas, not here
            on_input_ok=(lambda: preload(spec, engine)) if spec.spec.executor == "local" else None)
    # Completed and stored, whatever the exit code below; its last engine was let go: main() must end
    # the process at once, also where the summary cannot be printed. A SIGTERM now changes nothing:
    # ignored, so that it cannot turn a completed run's 0 or 65 into 130.
    _finished_run["executor"] = spec.spec.executor
    ignore_stop_signals()
    if not quiet and stdout_open():  # closed (`>&-`): the run's outcome is its database and exit code
        say(run_summary(summary))
    limit = spec.spec.output.max_failed_fraction
    if summary.failed_fraction > limit:
        left_out = f", {summary.rows_rejected:,} of them left out for null or repeated ids" if summary.rows_rejected else ""
        share, allowed = _apart(summary.failed_fraction, limit)
        raise TooManyFailed(f"the run completed, but {summary.rows_not_ok:,} of the input's {summary.rows_judged:,} rows "
                            f"({share}{left_out}) are not ok (output.max_failed_fraction: {allowed}); "
                            f"see: {_status_command(job, overrides)}")


def _apart(share: float, limit: float) -> tuple[str, str]:
    """Two shares as percentages with the decimals that tell them apart (10.0% over a limit of
    9.99% read as over 10.0%)."""
    for places in range(1, 6):
        a, b = f"{share:.{places}%}", f"{limit:.{places}%}"
        if a != b:
            return a, b
    return f"{share * 100!r}%", f"{limit * 100!r}%"


def _status_command(job: str, overrides: tuple[str, ...]) -> str:
    """The `runner status` that shows this run's rows: with its --set settings, which may name
    another database or job name (shell-quoted, to paste)."""
    import shlex

    return shlex.join(["runner", "status", *(a for o in overrides for a in ("--set", o)), job])


_finished_run: dict = {}  # set when `runner run` completed: main() may then exit at once


def _exit_now(executor: str, code: int = 0) -> None:
    """Leave without the interpreter tearing torch, CUDA and vLLM down module by module (seconds
    on a GPU machine, on the user's wall clock; ~1.5 s on this project's CPU machine). Safe after a
    completed run, also one that exits 65 for too many rows not ok: the results database is
    closed, an engine core in a process of its own shut down (one in this process ends here: see
    Engine.let_go), and the kernel releases the job's lock."""
    if executor == "ray":  # a local Ray cluster is stopped by ray.shutdown, not by the kernel
        import ray

        ray.shutdown()
    remove_scratch()  # os._exit runs no atexit handler
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`runner run ... | head`): nothing left to say there
            pass
    os._exit(code)


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
    say(f"{'Converted' if converted else 'Already prepared'}: {path}")


for _module in ("runner.cli_check", "runner.cli_results", "runner.cli_stored", "runner.cli_speculation"):  # register their commands on `cli`
    importlib.import_module(_module)


def main():  # console-script entry point; the guard matters for vLLM's spawned workers
    note_process_start()
    reopen_closed()
    keep_ignoring_after_stop()
    try:
        cli()
    except SystemExit as exc:
        if _finished_run and isinstance(exc.code, (int, type(None))):
            _exit_now(_finished_run["executor"], exc.code or 0)
        if exc.code == 130:  # stopped, and said so: a second stop during the interpreter's exit
            ignore_stop_signals(ctrl_c=True)  # would end it by the signal instead of 130
        raise


if __name__ == "__main__":
    # `python -m runner.cli`: the commands of the other cli_* modules register on the
    # imported module's group, not on this __main__ copy of it.
    importlib.import_module("runner.cli").main()
