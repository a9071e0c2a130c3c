"""Commands that read a results database: stats, report, export (status and prune: runner/cli_stored.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import click

from runner.cli import cli, reports_errors
from runner.cli_output import check_stdout, confirm, say, stats_table, warn
from runner.summary import fmt, killed_run_stats, plural, process_gone, run_status


def _open_store(job, db, overrides=()):
    """The results database named by --job (with its --set settings) or --db, and the job's name
    when --job was given."""
    from runner.errors import SpecError
    from runner.store import Store

    job_name = None
    if job and db:  # silently reading one of them would show another job's results
        raise SpecError("give --job JOB or --db DATABASE, not both")
    if overrides and not job:
        raise SpecError("--set changes a job's settings: give it with --job JOB, not --db")
    if job:
        from runner.unloaded_job import job_results

        db, job_name = job_results(job, overrides)  # results only: the schema and engine config may be gone
    if not db:
        raise SpecError("give --job JOB or --db DATABASE")
    _database_here(Path(db), job_name)
    return Store.for_reading(db), job_name


def _run_of(store, run_id: int, job_name) -> dict:
    """Run run_id's record; NotFound where there is none, or where --job named another job (jobs
    may share a database)."""
    from runner.errors import NotFound

    run = store.run(run_id)
    if run is None:
        raise NotFound(f"{store.path}: no run {run_id}")
    if job_name is not None and run["job_name"] != job_name:
        raise NotFound(f"{store.path}: run {run_id} is of job {run['job_name']}, not of {job_name}")
    return run


def _database_here(db: Path, job_name) -> None:
    """NotFound where nothing is at `db` yet (the job has not run); StoreError where something else
    is in the way (a folder, a path through a file), which a run would fail on too."""
    from runner.errors import NotFound, StoreError
    from runner.store_paths import nearest_existing
    from runner.store_sqlite import table_names

    if db.is_file():
        # An empty file (`touch`ed, or left by a tool) holds no results: reading it must not write
        # a schema into it. (A database in WAL mode is never empty: its header is written first.)
        if db.stat().st_size == 0:
            raise NotFound(f"{db}: an empty file, no results database yet")
        if table_names(db) == set():  # SQLite, but nothing in it: a read must not give it the schema either
            raise NotFound(f"{db}: an empty SQLite database, no results yet")
        return
    if db.exists():
        raise StoreError(f"{db}: not a database file")
    folder = nearest_existing(db)
    if not folder.is_dir():
        raise StoreError(f"{db}: {folder} is not a folder")
    raise NotFound(f"{db}: no results database here yet" + (f" ({job_name} has not run)" if job_name else ""))


def db_options(fn):
    for option in reversed([
        click.option("--job", "job", type=click.Path(dir_okay=False), help="Job file whose database to read."),
        click.option("--db", "db", type=click.Path(dir_okay=False), help="Results database to read."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="With --job: a job setting as `runner run --set` took it (e.g. output.database=...)."),
    ]):
        fn = option(fn)
    return fn


@cli.command()
@click.argument("run_id", required=False, type=int)
@db_options
@click.option("--last", "last", default=1, show_default=True, type=click.IntRange(min=1), help="How many recent runs to show.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout: runs, their stats and row counts.")
@click.option("--with-idle", is_flag=True,
              help="Count runs that had nothing to do (every row already stored); left out by default.")
@reports_errors
def stats(run_id, job, db, overrides, last, as_json, with_idle):
    """Show the stats of run RUN_ID, or of the last runs of a job that ran rows (a rerun that
    found every row stored is left out unless --with-idle: its zero throughput is not the job's).

    \b
    Example:
      runner stats --job jobs/summarize.yaml --last 5
      runner stats 3 --db out/summarize.sqlite
      runner stats --job jobs/summarize.yaml --json | jq '.[0].stats.documents_per_s'
    """
    from runner.errors import NotFound, SpecError

    if run_id is not None and last != 1:
        raise SpecError("give RUN_ID or --last N, not both")
    check_stdout()
    try:
        store, job_name = _open_store(job, db, overrides)
        runs = [_run_of(store, run_id, job_name)] if run_id is not None else store.latest_runs(job_name, last, with_idle)
        if not runs:
            if job_name and not store.latest_runs(job_name):  # a misspelt --set name=...: not its idle runs
                raise NotFound(f"{store.path}: no runs of {job_name}")
            raise NotFound(f"{store.path}: no runs yet" + ("" if with_idle else " that ran rows (--with-idle: all)"))
    except NotFound:
        if as_json and run_id is None:  # for monitoring: a job that has not run has no runs, not an error
            say("[]")
            return
        raise
    if as_json:
        text = json.dumps([_run_json(store, r) for r in runs], indent=1, default=str)
        store.check_unchanged()  # read without locks while a run wrote: not printed for monitoring
        say(text)
        return
    shown = []  # printed once the read is known whole (check_unchanged)
    for r in runs:
        s = store.stats(r["id"]) or killed_run_stats(r)
        status = run_status(r)
        shown.append(f"run {r['id']}  {r['job_name']}  {status}  started {r['started_at_utc']}")
        counts, gone = store.result_counts(r["id"])
        shown.append(stats_table(s, counts, [
            ("rows run again", fmt(s.get("rows_redone"))),
            *([("rows no longer stored", f"{gone:,} (replaced, then deleted)")] if gone else []),
            ("engine", f"{r['engine_backend'] or '-'} {r['engine_version'] or ''} {r['engine_settings_json'] or ''}"),
            ("engine log", r.get("log_path") or "-"),
        ] + ([("error", r["error"])] if r["error"] else [])))
    store.check_unchanged()
    for text in shown:
        say(text)


DATA_SUFFIXES = (".parquet", ".pq", ".csv", ".jsonl", ".json", ".ndjson", ".gz", ".bz2")


def _file_path(output: str) -> Path:
    """-o's file. A name ending in a slash means a folder: Path() would drop the slash and write a
    file of the folder's name."""
    from runner.errors import OutputFileError

    if not output:
        raise OutputFileError("-o: the name is empty: give a file name")
    if output.endswith(("/", os.sep)):
        raise OutputFileError(f"{output}: names a folder: give a file name")
    return Path(output)


def _write_text(path: Path, text: str, reading: Path, keep) -> None:
    from runner.whole_file import write_whole

    write_whole(path, lambda part: part.write_text(text, encoding="utf-8"), reading=reading, keep=keep)


def _job_sources(job, overrides, run: Optional[dict] = None):
    """The test of what of the job's own files a path is (unloaded_job.job_sources): an export or
    report is not written over them. With --db, the job file the run was started from, if it is
    still there (its --set settings are not known: the file as it is now). None: nothing to guard."""
    from runner.unloaded_job import job_sources

    if job:
        return job_sources(job, overrides)
    path = (run or {}).get("job_path")
    return job_sources(path) if path and Path(path).is_file() else None


def _run_json(store, r: dict) -> dict:
    """A run as JSON: its record (JSON columns parsed), stats, result counts by status and how many
    of its rows are no longer stored."""
    run = {k: (json.loads(v) if k.endswith("_json") and v else v) for k, v in r.items()}
    stats = {k: (json.loads(v) if k.endswith("_json") and v else v)
             for k, v in (store.stats(r["id"]) or killed_run_stats(r)).items()}
    counts, gone = store.result_counts(r["id"])
    return {"run": run, "stats": stats, "rows_by_status": counts, "rows_not_stored": gone,
            "process_gone": process_gone(r)}


@cli.command()
@click.argument("run_id", type=int)
@db_options
@click.option("-o", "--output", "output", default="-", show_default=True, type=click.Path(allow_dash=True),
              help="HTML file to write; - for stdout.")
@reports_errors
def report(run_id, job, db, overrides, output):
    """Write an HTML report of run RUN_ID: throughput over time, per-group cache hits, statuses, tokens.

    The file is self-contained (plots are inline SVG) and opens in any browser.

    \b
    Example:
      runner report 3 --job jobs/summarize.yaml -o report.html
    """
    from runner.report import render_report

    if output != "-" and Path(output).suffix.lower() in DATA_SUFFIXES:  # meant `runner export`
        from runner.errors import OutputFileError

        raise OutputFileError(f"{output}: a report is HTML: name the file .html (runner export writes results "
                              "as Parquet, CSV or JSON Lines)")
    if output == "-":
        check_stdout("give -o FILE.html")
    store, job_name = _open_store(job, db, overrides)
    run = _run_of(store, run_id, job_name)
    html = render_report(store, run_id)
    store.check_unchanged()
    if output == "-":
        say(html, nl=False)
        return
    _write_text(_file_path(output), html, reading=store.path, keep=_job_sources(job, overrides, run))
    confirm(f"Report: {output}")


@cli.command()
@click.argument("run_id", required=False, type=int)
@db_options
@click.option("--format", "fmt_", type=click.Choice(["parquet", "csv", "jsonl"], case_sensitive=False), default=None,
              help="Default: from the output file's name (.parquet, .csv, .jsonl); needed for stdout.")
@click.option("-o", "--output", "output", default="-", show_default=True, type=click.Path(allow_dash=True),
              help="File to write; - for stdout.")
@reports_errors
def export(run_id, job, db, overrides, fmt_, output):
    """Export results, with the extraction's top-level fields as columns: run RUN_ID's (those a
    later run replaced included), or without RUN_ID the whole job's (--job: the latest result of
    every row, whichever run made it).

    The result's own columns come first (row_id, group_key, status, error, token counts,
    finish_reason, latency_ms, attempts, first_status, extraction_json). Then the extraction's
    fields: a scalar as extraction_FIELD; an array, an object or a field of several types as JSON
    text in extraction_FIELD_json, every value JSON, a string quoted (a name taken already, as by
    a field called json, gets _2). Then run_id, fingerprint, created_at_utc, the model's raw
    output_text and document_tokens_cut. Row ids are text, whatever their type in the input.
    The job's own files (with --job, or with --db the job file the run was started from) are
    refused as -o, as is the database; a compressed name (.gz) is refused: compress the file after.

    \b
    Example:
      runner export --job jobs/summarize.yaml -o results.parquet
      runner export 3 --job jobs/summarize.yaml --format jsonl | jq .extraction_summary
    """
    from runner.errors import SpecError
    from runner.export import export_run, format_for

    target = None if output == "-" else _file_path(output)
    fmt_ = format_for(output, fmt_)
    if target is None:
        check_stdout("give -o FILE")
    store, job_name = _open_store(job, db, overrides)
    if run_id is None and job_name is None:
        raise SpecError("give RUN_ID, or --job JOB to export the whole job")
    run = _run_of(store, run_id, job_name) if run_id is not None else None
    to_stdout = output == "-"
    n = export_run(store, run_id, fmt_, target, None if run_id is not None else job_name,
                   keep=_job_sources(job, overrides, run))
    (warn if to_stdout else confirm)(f"Exported {plural(n, 'row')} to {'stdout' if to_stdout else output}")
    # against the rows written, read in one snapshot: a prune while it ran would make a second read differ
    stats = store.stats(run_id) if run_id is not None else None
    if stats and (gone := stats["rows_total"] - n) > 0:
        warn(f"Note: run {run_id} stored {plural(gone, 'more row')} than are kept now (replaced, then deleted)")
