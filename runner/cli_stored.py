"""Commands about a job's stored rows and their versions: status (what is stored, by which version of
the job, and what the next run has to do) and prune (older replaced versions out of results_history)."""
from __future__ import annotations

import click

from runner.cli import cli, reports_errors
from runner.cli_output import check_stdout, say, table
from runner.summary import plural


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="A job setting as `runner run --set` took it: the version of the job to compare with.")
@reports_errors
def status(job, overrides):
    """Show JOB's stored rows by the version of the job that made them (their fingerprint).

    The current version's rows are kept by the next run; rows made by another version (a changed
    schema, prompt, sampling or model) run again, and the parts that changed are listed. The last
    line counts what the next `runner run` has to do with the input as it is now (read and checked
    as a run checks it; no engine starts). A job that no longer loads (its schema or prompts gone)
    shows its stored rows, not compared with it, then why it does not load (exit 2).

    \b
    Example:
      runner status jobs/summarize.yaml
    """
    from runner.cli_results import _open_store  # here: under `python -m runner.cli`, cli_results is still loading
    from runner.errors import ModelError, NotFound, SpecError
    from runner.fingerprint import result_fingerprint
    from runner.models import missing_model
    from runner.lock import holder
    from runner.spec import load_job
    from runner.unloaded_job import job_results

    check_stdout()  # what is stored is the output: closed, an error
    try:
        spec, unloaded = load_job(job, overrides, check_engine=False), None  # results only: no engine starts
    except SpecError as exc:  # a retired job (its schema or prompts gone): what is stored still shows,
        spec, unloaded = None, exc  # then the error, whose exit code (2) monitoring reads
    if spec is not None and not (spec.model_path / "config.json" if spec.spec.executor == "local"
                                 else spec.model_path).exists():
        # the fingerprints hold the model's files: without them every row would read as changed (a
        # Ray job's driver may hold its tokenizer alone, as validate and run accept)
        spec, unloaded = None, ModelError(missing_model(spec.model_path))
    name = spec.name if spec is not None else job_results(job, overrides)[1]
    next_run = (lambda store: _next_run(spec, store)) if spec is not None else (
        lambda store: "next run: not counted: the job does not load (below)")
    try:
        store, _ = _open_store(job, None, overrides)
    except NotFound as exc:  # no file yet, or an empty one
        if unloaded is not None:
            raise unloaded from None
        say(f"job {name}: no rows stored yet ({exc})")
        say(next_run(None))
        return
    current, components = result_fingerprint(spec) if spec is not None else (None, None)
    known = store.fingerprint_components(name)
    *groups, history = store.rows_by_fingerprint(name)
    say(f"job {name}: {plural(sum(g['rows'] for g in groups), 'row')} stored in {store.path}")
    pid = holder(store.path, name)
    if pid is not None:  # each count below is read at its own moment
        say(f"running now: pid {pid} holds the job's lock (run, calibrate, verify, distill or prune); "
            "the counts below move while it stores rows")
    rows = [_version_line(g, spec is not None, current, known, components) for g in groups]
    if rows:
        say(table(rows))
    say(f"earlier results kept in results_history: {history['history_rows']:,}")
    say(next_run(store))
    store.check_unchanged()
    if unloaded is not None:
        raise unloaded from None


def _version_line(group: dict, compared: bool, current, known: dict, components) -> tuple[str, str]:
    """status's line for one version of the job's stored rows: (fingerprint, what it is)."""
    from runner.fingerprint import changed_parts

    fp = group["fingerprint"]
    if not compared:
        what = "not compared: the job does not load as it is now"
    elif fp == current:
        what = "current"
    elif fp is None:
        what = "made before fingerprints (kept; --restart redoes them)"
    else:
        what = "changed: " + (", ".join(changed_parts(known[fp], components)) if fp in known else "unknown")
    statuses = ", ".join(f"{k} {v:,}" for k, v in sorted(group["statuses"].items()))
    aside = f"; {group['set_aside']:,} of them set aside by --restart" if group["set_aside"] else ""
    return fp or "-", (f"{plural(group['rows'], 'row')} ({statuses}), made {group['first_at_utc'][:16]} .. "
                       f"{group['last_at_utc'][:16]}; {what}{aside}")


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--keep-versions", required=True, type=click.IntRange(min=0, max=1_000_000),
              help="Replaced versions to keep of each row, the most recent; 0 deletes them all.")
@click.option("--dry-run", is_flag=True, help="Count the rows that would be deleted; delete nothing.")
@click.option("--wait", is_flag=True, help="If a run of the job is under way, wait for it instead of exiting 75.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="A job setting as `runner run --set` took it (output.database, say).")
@reports_errors
def prune(job, keep_versions, dry_run, wait, overrides):
    """Delete from JOB's database the older replaced versions of its rows (results_history).

    A changed job, --retry-failed and --restart move the rows they replace to results_history, so
    that the runs that made them still show and export them: a job restarted every night grows by
    its size each time. Each row keeps its N most recently replaced versions. The rows of `results`
    (what the next run keeps) are never deleted, nor the runs' records and stats; an older run's
    export and report then hold only its rows still stored, and say how many are not. While a run
    of the job is under way it exits 75 (--wait: waits for it). SQLite reuses the freed pages; the
    file does not shrink.

    \b
    Example:
      runner prune jobs/summarize.yaml --keep-versions 7    # cron, after a nightly --restart
    """
    from runner.cli_results import _open_store
    from runner.errors import NotFound
    from runner.unloaded_job import job_results

    if dry_run:
        check_stdout()  # the count is the output; a real prune does its work and says nothing
    database, name = job_results(job, overrides)  # the schema and engine config may be gone
    try:
        store, _ = _open_store(job, None, overrides)
    except NotFound as exc:
        say(f"job {name}: nothing to prune ({exc})")
        return
    if not store.latest_runs(name):  # a misspelt --set name=... deletes nothing, and says why
        say(f"job {name}: nothing to prune (no run of it in {database})")
        return
    if dry_run:
        count = store.prune_history(name, keep_versions, dry_run=True)
        store.check_unchanged()
    else:
        from runner.lock import JobLock

        with JobLock(database, name, wait=wait):  # not while a run moves rows into the history
            count = store.prune_history(name, keep_versions)
    kept = {0: "none kept", 1: "each row keeps its latest replaced version"}.get(
        keep_versions, f"each row keeps its {keep_versions:,} latest replaced versions")
    say(f"job {name}: {plural(count, 'replaced row')} {'would be ' if dry_run else ''}deleted from "
        f"results_history ({kept})")


def _next_run(spec, store) -> str:
    """What the next `runner run` of spec has to do, as one line: input rows to run (new, or stored
    by another version of the job) and, with --retry-failed, rows stored but not ok as well. Counted
    on disk against the input's row ids, as `run` counts them; an input that a run would refuse is
    named, not raised: status still shows what is stored."""
    from runner.errors import InputError, SpecError
    from runner.fingerprint import result_fingerprint
    from runner.readers import LocalReader
    from runner.resume import length_rule_changes, renamed_from

    try:
        scan = LocalReader(spec.input_path, spec.spec.input).scan(keep_ids=store is not None)
    except (InputError, SpecError) as exc:
        return f"next run: not counted: {exc}"
    if not scan.rows:  # an empty input is refused by the scan: every row was left out as bad
        return f"next run: nothing to run (all {plural(len(scan.skip), 'input row')} left out: null or repeated ids)"
    if store is None:
        return f"next run: all {plural(scan.rows, 'input row')}"
    try:
        fingerprint, components = result_fingerprint(spec)
        counts = store.input_counts(spec.name, scan.ids.path, fingerprint,
                                    length_rule_changes(store, spec, fingerprint, components))
        renamed = renamed_from(store, spec, scan, fingerprint) if not counts.stored else None
    finally:
        scan.ids.close()
    note = f"Note: {renamed}\n" if renamed else ""
    todo, retry = scan.rows - counts.current, scan.rows - counts.ok
    redo = counts.stored - counts.current
    also = f"; {retry:,} with --retry-failed" if retry != todo else ""
    if not todo:
        return f"next run: nothing to run (all {plural(scan.rows, 'input row')} stored){also}"
    aside = counts.set_aside  # rows --restart marked to be run again
    parts = ([f"{todo - redo:,} new"] if todo > redo or not redo else []) + (
        [f"{redo - aside:,} stored by another version"] if redo > aside else []) + (
        [f"{aside:,} set aside by --restart"] if aside else [])
    return f"{note}next run: {todo:,} of {plural(scan.rows, 'input row')} to run ({', '.join(parts)}){also}"
