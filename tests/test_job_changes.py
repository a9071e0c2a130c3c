"""Resume that notices a changed job, --retry-failed, the failed-rows exit code, rows whose prompt fails."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from runner.cli import cli
from runner.engines.fake import FakeEngine
from runner.lock import JobLock
from runner.run import run_job
from runner.spec import load_job
from tests.conftest import SCHEMA, SYSTEM_A
from tests.test_crash_safety import runner_cmd


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])  # output: stdout and stderr


def rows(db, *cols):
    con = sqlite3.connect(db)
    try:
        return con.execute(f"SELECT {', '.join(cols)} FROM results ORDER BY row_id").fetchall()
    finally:
        con.close()


def count(db, table):
    con = sqlite3.connect(db)
    try:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        con.close()


def edit(path, fn):
    spec = yaml.safe_load(path.read_text())
    fn(spec)
    path.write_text(yaml.safe_dump(spec))


def test_a_changed_schema_redoes_the_stored_rows_and_keeps_the_old_ones(make_job, tmp_path):
    job = make_job(rows=6)
    db = tmp_path / "out" / "results.sqlite"
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    before = rows(db, "row_id", "fingerprint", "extraction_json")
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0  # unchanged: nothing to do
    assert count(db, "results_history") == 0
    new = SCHEMA | {"properties": SCHEMA["properties"] | {"topic": {"type": "string", "maxLength": 30}},
                    "required": SCHEMA["required"] + ["topic"]}
    (tmp_path / "schemas" / "out.json").write_text(json.dumps(new))
    status = invoke("status", job)
    assert status.exit_code == 0 and "6 rows (ok 6)" in status.output and "changed: output_schema" in status.output
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0, out.output
    assert "running 6 stored rows again" in out.output and "changed: output_schema" in out.output
    after = rows(db, "row_id", "fingerprint", "extraction_json")
    assert [r[0] for r in after] == [r[0] for r in before]
    assert all(json.loads(r[2])["topic"] for r in after) and {r[1] for r in after} != {r[1] for r in before}
    history = sqlite3.connect(db).execute("SELECT row_id, fingerprint, extraction_json FROM results_history "
                                          "ORDER BY row_id").fetchall()
    assert history == before  # nothing lost
    status = invoke("status", job)
    assert "current" in status.output and "results_history: 6" in status.output
    # the first run's export is still its own rows, as it made them, and says which run and job made them
    got = {}
    for run_id in (1, 3):
        out = CliRunner().invoke(cli, ["export", str(run_id), "--db", str(db), "--format", "jsonl"])
        assert out.exit_code == 0, out.output
        got[run_id] = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["row_id"], r["fingerprint"], r["extraction_json"]) for r in got[1]] == before
    assert [(r["row_id"], r["fingerprint"], r["extraction_json"]) for r in got[3]] == after
    assert {r["run_id"] for r in got[1]} == {1} and {r["run_id"] for r in got[3]} == {3}
    assert all(r["output_text"] and r["created_at_utc"] for r in got[1] + got[3])
    # the columns added later come after the extraction's, where readers by position do not look
    assert list(got[1][0])[-7:] == ["extraction_summary", "extraction_sentiment", "run_id", "fingerprint",
                                    "created_at_utc", "output_text", "document_tokens_cut"]


def test_changed_sampling_names_the_field_and_a_new_row_runs_alone(make_job, tmp_path):
    job = make_job(rows=5)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    edit(job, lambda s: s["sampling"].update(max_tokens=32))
    out = invoke("run", "--engine", "fake", job)
    assert "running 5 stored rows again" in out.output and "sampling.max_tokens" in out.output
    stats = sqlite3.connect(tmp_path / "out" / "results.sqlite").execute(
        "SELECT rows_total, rows_redone FROM run_stats ORDER BY run_id").fetchall()
    assert stats == [(5, 0), (5, 5)]


def test_switching_on_too_long_runs_again_only_the_rows_it_applies_to(make_job, tmp_path):
    """Our own message tells a user whose long rows failed to set input.on_too_long: truncate; that
    ran every stored row again (hours of a nightly job) where only the long rows can change."""
    from tests.conftest import write_docs

    docs = write_docs(tmp_path / "data" / "long.parquet", 6)
    t = pq.read_table(docs).to_pydict()
    t["text"][4] = "word " * 3000  # longer than max_model_len=1024
    pq.write_table(pa.table(t), docs)
    job = make_job(docs=docs)
    db = tmp_path / "out" / "results.sqlite"
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    assert [r for r in rows(db, "row_id", "status") if r[1] != "ok"] == [("r004", "failed")]
    made = dict(rows(db, "row_id", "created_at_utc"))

    edit(job, lambda s: s["input"].update(on_too_long="truncate"))
    assert invoke("status", job).output.splitlines()[-1] == (
        "next run: 1 of 6 input rows to run (1 stored by another version)")
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0 and "running 1 stored row again" in out.output, out.output
    assert "changed: on_too_long" in out.output
    after = {r[0]: r[1:] for r in rows(db, "row_id", "status", "document_tokens_cut", "created_at_utc", "fingerprint")}
    assert after["r004"][0] == "ok" and after["r004"][1] > 0
    assert all(after[r][2] == made[r] for r in made if r != "r004")  # not run again
    assert len({a[3] for a in after.values()}) == 1  # every row is the job's current version
    assert count(db, "results_history") == 1
    kept = ("input.on_too_long or engine.max_model_len changed: 5 stored rows that it does not change kept "
            "(neither cut nor too long)")
    assert kept in out.output
    assert kept in json.loads(sqlite3.connect(db).execute(
        "SELECT engine_choice_json FROM run_stats ORDER BY run_id DESC").fetchone()[0])["notes"]

    edit(job, lambda s: s["input"].update(on_too_long="fail"))  # back: the cut row fails again, alone
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0 and "running 1 stored row again" in out.output, out.output
    assert dict(rows(db, "row_id", "status"))["r004"] == "failed"
    # anything else changed with it: every row runs again
    edit(job, lambda s: s["input"].update(on_too_long="truncate") or s["sampling"].update(max_tokens=32))
    out = invoke("run", "--engine", "fake", job)
    assert "running 6 stored rows again" in out.output, out.output
    # --restart with only the rule changed: every row again, none "kept" by the rule
    edit(job, lambda s: s["input"].update(on_too_long="fail"))
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    edit(job, lambda s: s["input"].update(on_too_long="truncate"))
    out = invoke("run", "--engine", "fake", "--restart", job)
    assert "running 6 stored rows again: --restart" in out.output and "kept" not in out.output, out.output


@pytest.mark.parametrize("stored_before_the_column", [False, True])
def test_a_row_near_the_room_runs_again_only_where_it_was_stored_before_cuts_were_recorded(
        make_job, tmp_path, stored_before_the_column):
    """Rows stored before results.document_tokens_cut existed may have been cut without a record:
    such a row whose prompt ends within a few tokens of the room runs again; a later one does not."""
    job = make_job(rows=3)
    db = tmp_path / "out" / "results.sqlite"
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE results SET prompt_tokens = ? WHERE row_id = 'r001'", (1024 - 64 - 5,))  # 5 under the room
        if stored_before_the_column:
            con.execute("UPDATE _migrations SET applied_at_utc = '9999' WHERE name = 'm012_document_tokens_cut'")
    con.close()
    edit(job, lambda s: s["input"].update(on_too_long="truncate"))
    again = 1 if stored_before_the_column else 0
    expected = (f"next run: {again} of 3 input rows to run ({again} stored by another version); 0 with --retry-failed"
                if again else
                "next run: nothing to run (all 3 input rows stored)")
    assert invoke("status", job).output.splitlines()[-1] == expected
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0 and (f"{again} run" in out.output), out.output


def test_retry_failed_runs_only_rows_that_are_not_ok(make_job, tmp_path):
    job = load_job(make_job(rows=8))
    bad = {"r001", "r004"}
    broken = lambda j: FakeEngine(SCHEMA, respond=lambda r: "not json" if r.row_id in bad else '{"summary": "s", "sentiment": "neutral"}')  # noqa: E731
    first = run_job(job, engine_factory=broken)
    assert first.counts["invalid_json"] == 2 and first.failed_fraction == 0.25
    seen = []

    def good(j):
        e = FakeEngine(SCHEMA)
        seen.append(e)
        return e

    again = run_job(job, engine_factory=good, retry_failed=True)
    assert sorted(r.row_id for r in seen[0].seen) == sorted(bad) and again.rows_redone == 2
    assert again.job_counts == {"ok": 8} and again.failed_fraction == 0
    db = tmp_path / "out" / "results.sqlite"
    assert count(db, "results_history") == 2


def test_too_many_rows_not_ok_exits_65_after_storing_them(make_job, tmp_path):
    impossible = SCHEMA | {"properties": SCHEMA["properties"] | {"summary": {"type": "string", "pattern": "^x$"}}}
    job = make_job(rows=6, schema=impossible, job={"output": {"max_failed_fraction": 0.05}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 65
    assert out.output.strip().startswith("Error: the run completed, but 6 of the input's 6 rows (100.0%) are not ok")
    assert rows(tmp_path / "out" / "results.sqlite", "status") == [("schema_mismatch",)] * 6
    edit(job, lambda s: s["output"].update(max_failed_fraction=1.0))
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0


def test_failed_rows_no_longer_in_the_input_do_not_count_against_the_failure_limit(make_job, tmp_path):
    """A nightly input that drops last night's failed rows: tonight's exit code is judged on
    tonight's input, not on every row the database ever stored."""
    job = make_job(rows=8, job={"output": {"max_failed_fraction": 0.05}})
    bad = {"r001", "r004"}
    broken = lambda j: FakeEngine(SCHEMA, respond=lambda r: "not json" if r.row_id in bad else '{"summary": "s", "sentiment": "neutral"}')  # noqa: E731
    first = run_job(load_job(job), engine_factory=broken)
    assert first.failed_fraction == 0.25
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 65  # still in the input: still counted
    docs = tmp_path / "data" / "docs.parquet"
    table = pq.read_table(docs)
    pq.write_table(table.filter(pa.array([i not in bad for i in table["id"].to_pylist()])), docs)
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0, out.output
    tonight = run_job(load_job(job), engine_factory=broken)
    assert tonight.job_counts == {"ok": 6} and tonight.failed_fraction == 0
    assert count(tmp_path / "out" / "results.sqlite", "results") == 8  # the dropped rows stay stored


def test_a_completed_run_over_the_failure_limit_exits_65_as_a_process_with_its_rows_stored(make_job, tmp_path):
    """As a process: the run completed, so it exits without tearing the engine down (os._exit)
    and still says why, with the database closed and the lock free for the next run."""
    impossible = SCHEMA | {"properties": SCHEMA["properties"] | {"summary": {"type": "string", "pattern": "^x$"}}}
    job = make_job(rows=4, schema=impossible, job={"output": {"max_failed_fraction": 0.05}})
    out = subprocess.run(runner_cmd("run", "--engine", "fake", "--quiet", job), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 65 and out.stderr.startswith("Error: the run completed, but 4 of the input's 4 rows")
    db = tmp_path / "out" / "results.sqlite"
    assert rows(db, "status") == [("schema_mismatch",)] * 4
    wal = db.with_name(db.name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0  # checkpointed and closed
    assert invoke("run", "--engine", "fake", "--quiet", "--retry-failed", job).exit_code == 65  # the lock is free


def test_main_leaves_through_os_exit_only_after_a_completed_run(make_job, monkeypatch):
    """Exit 65 after a completed run skips the interpreter's teardown like exit 0; a run that did
    not complete (here: its input is missing, exit 3) leaves the normal way."""
    import sys

    import runner.cli as cli_module

    class Left(Exception):
        pass

    codes = []

    def fake_exit(code):
        codes.append(code)
        raise Left

    impossible = SCHEMA | {"properties": SCHEMA["properties"] | {"summary": {"type": "string", "pattern": "^x$"}}}
    job = make_job(rows=3, schema=impossible, job={"output": {"max_failed_fraction": 0.05}})
    monkeypatch.setattr(cli_module.os, "_exit", fake_exit)
    monkeypatch.setattr(cli_module, "_finished_run", {})
    monkeypatch.setattr(sys, "argv", ["runner", "run", "--engine", "fake", "--quiet", str(job)])
    with pytest.raises(Left):
        cli_module.main()
    assert codes == [65]
    monkeypatch.setattr(cli_module, "_finished_run", {})
    monkeypatch.setattr(sys, "argv", ["runner", "run", "--engine", "fake", "--quiet", "--set", "input.path=none.parquet",
                                      str(job)])
    with pytest.raises(SystemExit) as left:
        cli_module.main()
    assert left.value.code == 3 and codes == [65]


def test_a_row_whose_prompt_cannot_be_built_is_a_failed_row(make_job, tmp_path):
    f = tmp_path / "data" / "docs.parquet"
    f.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["t1", "t2", "t3"], "system_prompt": [SYSTEM_A] * 3,
                             "n": pa.array([7, None, 9], pa.int64())}), f)
    job = make_job(docs=f, job={"input": {"extra_columns": ["n"]}, "prompts": {"user_template": "{n:03d} {text}"},
                                "output": {"max_failed_fraction": 0.5}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0, out.output
    got = rows(tmp_path / "out" / "results.sqlite", "row_id", "status", "error")
    assert [(r, s) for r, s, _ in got] == [("a", "ok"), ("b", "failed"), ("c", "ok")]
    assert "prompt could not be built from prompts.user_template: ValueError" in got[1][2]


def test_quiet_prints_nothing_and_engine_output_goes_to_the_log(make_job, tmp_path):
    job = make_job(rows=4)
    done = subprocess.run(runner_cmd("run", "--engine", "fake", "--quiet", job), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""
    log = tmp_path / "out" / "results.sqlite.t.log"
    assert log.is_file() and "runner run" in log.read_text()
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT log_path FROM runs").fetchone()[0] == str(log)
    done = subprocess.run(runner_cmd("run", "--engine", "fake", "--restart", job), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "Results:" in done.stdout  # not quiet: the summary, on stdout


def test_status_of_a_job_that_has_not_run_says_so(make_job, tmp_path):
    out = invoke("status", make_job(rows=2))
    assert out.exit_code == 0 and "no rows stored yet" in out.output and "has not run" in out.output
    assert not (tmp_path / "out" / "results.sqlite").exists()  # reading creates no database


def test_status_counts_what_the_next_run_has_to_do_as_the_run_does(make_job, tmp_path):
    job = make_job(rows=6)
    assert invoke("status", job).output.splitlines()[-1] == "next run: all 6 input rows"
    assert invoke("run", "--engine", "fake", "--quiet", "--limit", "4", job).exit_code == 0
    out = invoke("status", job)
    assert out.exit_code == 0
    assert out.output.splitlines()[-1] == "next run: 2 of 6 input rows to run (2 new)"  # --retry-failed: the same
    # a changed schema that no output can meet: the 4 stored rows run again, and then none is ok
    impossible = SCHEMA | {"properties": SCHEMA["properties"] | {"summary": {"type": "string", "pattern": "^x$"}}}
    (tmp_path / "schemas" / "out.json").write_text(json.dumps(impossible))
    # (--retry-failed keeps every ok row, whatever version made it: only the 2 new ones would run)
    assert invoke("status", job).output.splitlines()[-1] == (
        "next run: 6 of 6 input rows to run (2 new, 4 stored by another version); 2 with --retry-failed")
    run = invoke("run", "--engine", "fake", "--quiet", job)
    assert run.exit_code == 0 and "6 rows" in invoke("status", job).output
    # what status counted is what the run did, and what is not ok waits for --retry-failed only
    assert count(tmp_path / "out" / "results.sqlite", "results") == 6
    assert invoke("status", job).output.splitlines()[-1] == "next run: nothing to run (all 6 input rows stored); 6 with --retry-failed"
    (tmp_path / "data" / "docs.parquet").unlink()  # status still shows what is stored
    out = invoke("status", job)
    assert out.exit_code == 0 and "6 rows (schema_mismatch 6)" in out.output
    assert out.output.splitlines()[-1].startswith("next run: not counted: ") and "docs.parquet" in out.output


def test_status_says_when_the_job_is_running_now(make_job, tmp_path):
    """Its counts move while a run stores rows: said, with the pid that holds the lock."""
    import os

    job = make_job(rows=3)
    assert invoke("run", "--engine", "fake", "--quiet", "--limit", "1", job).exit_code == 0
    assert "running now" not in invoke("status", job).output
    with JobLock(tmp_path / "out" / "results.sqlite", "t"):
        out = invoke("status", job)
    assert out.exit_code == 0
    assert out.output.splitlines()[1] == (f"running now: pid {os.getpid()} holds the job's lock (run, calibrate, verify, "
                                          "distill or prune); the counts below move while it stores rows")
    assert "running now" not in invoke("status", job).output


def test_status_of_an_input_whose_every_row_is_left_out_says_so(make_job, tmp_path):
    docs = tmp_path / "data" / "bad.parquet"
    docs.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": pa.array([None, None], pa.string()), "text": ["a", "b"],
                             "system_prompt": ["S", "S"]}), docs)
    job = make_job(docs=docs, job={"input": {"on_bad_row": "store"}})
    out = invoke("status", job)
    assert out.exit_code == 0
    assert out.output.splitlines()[-1] == "next run: nothing to run (all 2 input rows left out: null or repeated ids)"


def test_prune_keeps_the_latest_replaced_versions_of_each_row_and_never_a_current_one(make_job, tmp_path):
    job = make_job(rows=3)
    db = tmp_path / "out" / "results.sqlite"
    out = invoke("prune", job, "--keep-versions", "1")
    assert out.exit_code == 0 and "nothing to prune" in out.output and not db.exists()
    assert invoke("run", "--engine", "fake", "--quiet", "--limit", "2", job).exit_code == 0  # run 1: r000, r001
    for _ in range(3):  # a job restarted every night: each run sets the last one's rows aside
        assert invoke("run", "--engine", "fake", "--quiet", "--restart", job).exit_code == 0  # runs 2-4: all 3
    for _ in range(2):  # another job in the same database, with a history of its own
        assert invoke("run", "--engine", "fake", "--quiet", "--restart", "--set", "name=other", job).exit_code == 0
    others = sqlite3.connect(db).execute("SELECT * FROM results_history WHERE job_name = 'other'").fetchall()
    assert len(others) == 3
    current = rows(db, "row_id", "run_id")
    assert {r[1] for r in current} == {4, 6} and count(db, "results_history") == 2 + 3 + 3 + 3
    con = sqlite3.connect(db)  # the table's physical order reversed (rebuilt, or copied by some tool)
    con.executescript("CREATE TEMP TABLE h AS SELECT * FROM results_history ORDER BY rowid DESC; "
                      "DELETE FROM results_history; INSERT INTO results_history SELECT * FROM h;")
    con.close()
    out = invoke("prune", job, "--keep-versions", "2", "--dry-run")
    assert out.exit_code == 0 and out.output.strip() == (
        "job t: 2 replaced rows would be deleted from results_history (each row keeps its 2 latest replaced versions)")
    assert count(db, "results_history") == 11  # a dry run deletes nothing
    assert invoke("prune", job, "--keep-versions", "2").exit_code == 0
    con = sqlite3.connect(db)
    # run 1's versions of r000 and r001 were each row's third: gone; r002 had only two
    assert con.execute("SELECT run_id, count(*) FROM results_history WHERE job_name = 't' GROUP BY run_id"
                       ).fetchall() == [(2, 3), (3, 3)]
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 6  # the runs' records and stats stay
    con.close()
    assert rows(db, "row_id", "run_id") == current
    # run 1's export and stats: its rows are gone, and they say so; its counts are still its own
    pruned = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "--format", "jsonl"])
    assert pruned.exit_code == 0 and pruned.stdout == ""
    assert "Note: run 1 stored 2 more rows than are kept now (replaced, then deleted)" in pruned.stderr
    stats = json.loads(CliRunner().invoke(cli, ["stats", "1", "--db", str(db), "--json"]).stdout)
    assert stats[0]["rows_by_status"] == {"ok": 2} and stats[0]["rows_not_stored"] == 2
    assert "rows no longer stored" in invoke("stats", "1", "--db", db).output
    kept = json.loads(CliRunner().invoke(cli, ["stats", "4", "--db", str(db), "--json"]).stdout)
    assert kept[0]["rows_not_stored"] == 0 and "no longer" not in invoke("stats", "4", "--db", db).output
    report = CliRunner().invoke(cli, ["report", "1", "--db", str(db)])
    assert report.exit_code == 0 and "rows no longer stored</th><td>2 (" in report.stdout
    assert "rows by status</th><td>ok 2<" in report.stdout  # as the run counted them
    out = invoke("prune", job, "--keep-versions", "0", "--set", "name=tt")  # a misspelt job: no run of it here
    assert out.exit_code == 0 and "nothing to prune (no run of it in" in out.output and count(db, "results_history") == 9
    from runner.lock import JobLock

    with JobLock(db, "t"):  # a run of the job is under way: it may be moving rows into the history
        out = invoke("prune", job, "--keep-versions", "0")
    assert out.exit_code == 75 and out.output.startswith("Error: ") and count(db, "results_history") == 9
    assert "use --wait to wait for it" in out.output  # which prune has
    import threading

    held = JobLock(db, "t").__enter__()
    threading.Timer(0.5, held.__exit__, (None, None, None)).start()  # the run ends half a second later
    out = invoke("prune", job, "--keep-versions", "1", "--wait")
    assert out.exit_code == 0 and "3 replaced rows deleted" in out.output and count(db, "results_history") == 6
    out = invoke("prune", job, "--keep-versions", "0")
    assert "3 replaced rows deleted" in out.output and "none kept" in out.output
    assert rows(db, "row_id", "run_id") == current
    assert sorted(sqlite3.connect(db).execute("SELECT * FROM results_history").fetchall()) == sorted(others)
    out = invoke("prune", job, "--keep-versions", str(2 ** 63))  # a number SQLite cannot hold: refused, not a traceback
    assert out.exit_code == 2 and "--keep-versions" in out.output


@pytest.mark.parametrize("args", [["stats", "--job"], ["export", "--format", "csv", "--job"], ["report", "1", "--job"]])
def test_reading_a_job_that_has_not_run_is_not_found_not_a_damaged_database(make_job, args):
    out = CliRunner().invoke(cli, [*args, str(make_job(rows=2))])
    assert out.exit_code == 7 and out.output.startswith("Error: ") and "has not run" in out.output


@pytest.mark.parametrize("place, message", [("folder", "not a database file"), ("under a file", "is not a folder")])
@pytest.mark.parametrize("args", [["status"], ["stats", "--json", "--job"], ["export", "--format", "csv", "--job"]])
def test_something_in_the_way_of_the_database_is_not_taken_for_a_job_that_has_not_run(make_job, tmp_path, args,
                                                                                        place, message):
    job = make_job(rows=2)
    (tmp_path / "in-the-way").write_text("a file")
    db = tmp_path / "db-folder" if place == "folder" else tmp_path / "in-the-way" / "results.sqlite"
    (tmp_path / "db-folder").mkdir()
    out = CliRunner().invoke(cli, [*args, str(job), "--set", f"output.database={db}"])
    assert out.exit_code == 6 and out.output.startswith("Error: ") and message in out.output, out.output


def test_a_run_half_replaced_later_still_shows_and_exports_all_its_rows_in_order(make_job, tmp_path):
    job = make_job(rows=12)
    db = tmp_path / "out" / "results.sqlite"

    def exported() -> list[str]:
        out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "--format", "jsonl"])
        return [json.loads(line)["row_id"] for line in out.stdout.splitlines()]

    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    first = exported()
    out = invoke("run", "--engine", "fake", "--quiet", "--limit", 6, "--set", "sampling.max_tokens=65", job)
    assert out.exit_code == 0, out.output
    replaced = sqlite3.connect(db).execute("SELECT count(*) FROM results_history WHERE run_id = 1").fetchone()[0]
    assert 0 < replaced < 12  # run 2 made some of run 1's rows again
    assert sorted(first) == [f"r{i:03d}" for i in range(12)] and exported() == first  # all, in the order stored
    got = json.loads(invoke("stats", "1", "--db", db, "--json").output)
    assert got[0]["rows_by_status"] == {"ok": 12}  # as export and report count them


def test_commands_that_read_leave_an_empty_database_file_empty(make_job, tmp_path):
    """A `touch`ed results file holds no rows: status, stats, export and prune --dry-run say so and
    write no schema into it; a run then uses it."""
    job = make_job(rows=3)
    db = tmp_path / "out" / "results.sqlite"
    db.parent.mkdir(parents=True, exist_ok=True)
    db.touch()
    out = invoke("prune", job, "--keep-versions", "1", "--dry-run")
    assert out.exit_code == 0 and f"nothing to prune ({db}: an empty file, no results database yet)" in out.output
    out = invoke("status", job)
    assert out.exit_code == 0 and f"no rows stored yet ({db}: an empty file" in out.output
    assert out.output.splitlines()[-1] == "next run: all 3 input rows"
    for command in (["stats"], ["export", "--format", "jsonl"]):  # NotFound's exit code, as for no file
        out = invoke(*command, "--job", job)
        assert out.exit_code == 7 and "an empty file, no results database yet" in out.output
    assert db.stat().st_size == 0
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    assert count(db, "results") == 3


def test_a_run_of_another_job_in_a_shared_database_is_not_shown_as_this_jobs(make_job):
    """Two jobs in one database: `stats 2 --job A` where run 2 is B's says so (exit 7) instead of
    showing B's run; export and report likewise. A run id with --last is refused, not ignored."""
    job = make_job(rows=3)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0  # run 1: t
    assert invoke("run", "--engine", "fake", "--quiet", "--set", "name=other", job).exit_code == 0  # run 2: other
    for args in (["stats", "2"], ["export", "2", "--format", "csv"], ["report", "2"]):
        out = invoke(*args, "--job", job)
        assert out.exit_code == 7 and out.output.startswith("Error: ") and "run 2 is of job other, not of t" in out.output
    assert invoke("stats", "1", "--job", job).exit_code == 0
    assert invoke("stats", "2", "--job", job, "--set", "name=other").exit_code == 0
    out = invoke("stats", "1", "--last", "3", "--job", job)
    assert out.exit_code == 2 and "give RUN_ID or --last N, not both" in out.output


def test_stats_tells_a_run_whose_process_was_killed_from_one_under_way(make_job, tmp_path):
    """A run killed outright stays `running` in the database until the next run marks it; stats
    (and --json's process_gone, for monitoring) say its process is gone."""
    import os
    import socket
    import subprocess

    job = make_job(rows=3)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    db = tmp_path / "out" / "results.sqlite"
    dead = subprocess.Popen(["true"])
    dead.wait()
    for pid, gone in ((dead.pid, True), (os.getpid(), False)):
        con = sqlite3.connect(db)
        con.execute("UPDATE runs SET status = 'running', pid = ?, host = ?", (pid, socket.gethostname()))
        con.commit()
        con.close()
        shown = json.loads(CliRunner().invoke(cli, ["stats", "--job", str(job), "--json"]).stdout)
        assert shown[0]["process_gone"] is gone and shown[0]["run"]["status"] == "running"
        line = invoke("stats", "--job", job).output.splitlines()[0]
        assert (f"running (its process {pid} is gone: killed, or quit by a second Ctrl-C; the next run marks it "
                "interrupted)" in line) is gone
        report = CliRunner().invoke(cli, ["report", "1", "--job", str(job)]).stdout  # the report says the same
        assert ("<th>status</th><td>running (its process" in report) is gone and "<th>status</th><td>running" in report
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    con = sqlite3.connect(db)
    con.execute("UPDATE runs SET status = 'completed'")
    con.commit()
    shown = json.loads(CliRunner().invoke(cli, ["stats", "--job", str(job), "--json", "--with-idle"]).stdout)
    assert shown[0]["process_gone"] is None


def test_sigterm_stops_a_command_that_is_not_a_run_with_one_line_and_130(make_job, tmp_path):
    """`runner prune --wait` stopped by cron's SIGTERM while a run holds the job: exit 130 and one
    `Error:` line that promises nothing about stored rows, not a bare death by signal (143)."""
    import signal
    import time

    from runner.lock import JobLock

    job = make_job(rows=2)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    db = tmp_path / "out" / "results.sqlite"
    with JobLock(db, "t"):
        proc = subprocess.Popen(runner_cmd("prune", job, "--keep-versions", "1", "--wait"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not _catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:  # its handler is set
            time.sleep(0.05)
        time.sleep(0.5)  # waiting for the lock
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    assert err == "Error: stopped by signal SIGTERM while it waited for the job's lock (nothing done)\n"


def _catches(pid: int, sig) -> bool:
    """Whether process pid has a handler for sig (Linux: SigCgt in /proc/PID/status)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    mask = next((int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith("SigCgt:")), 0)
    return bool(mask & (1 << (int(sig) - 1)))


def test_an_archived_job_without_its_schema_or_engine_config_still_shows_exports_and_prunes(make_job, tmp_path):
    """Reading and pruning results needs only the job file's name and database: its schema, engine
    config and input may be gone (a job retired, its folder cleaned)."""
    job = make_job(rows=3)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    shown = [invoke("stats", "--job", job).output, invoke("export", "--job", job, "--format", "jsonl").output]
    for gone in ("schemas/out.json", "configs/engine.yaml", "data/docs.parquet"):
        (tmp_path / gone).unlink()
    assert [invoke("stats", "--job", job).output, invoke("export", "--job", job, "--format", "jsonl").output] == shown
    for args in (("report", "1", "--job", job, "-o", tmp_path / "r.html"), ("prune", job, "--keep-versions", "1")):
        out = invoke(*args)
        assert out.exit_code == 0, (args, out.output)
    bad = invoke("stats", "--job", job, "--set", "output.databse=x.sqlite")  # the job file itself is still checked
    assert bad.exit_code == 2 and "output.databse: unknown key" in bad.output


def test_a_large_engine_log_is_kept_as_dot_1_and_a_new_one_started(make_job, tmp_path, monkeypatch):
    """A nightly job appends to its engine log: once the log reaches LOG_KEEP_BYTES, the next run
    moves it to LOG.1 (replacing the older one) and writes a new log; below it, runs append."""
    from runner import console

    monkeypatch.setattr(console, "LOG_KEEP_BYTES", 4096)
    job = make_job(rows=3)
    log = tmp_path / "out" / "results.sqlite.t.log"
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    first = log.read_text()
    assert invoke("run", "--engine", "fake", "--quiet", "--restart", job).exit_code == 0
    assert log.read_text().startswith(first) and log.read_text().count("==== ") == 2  # small: appended
    log.write_text("old night\n" * 500)  # 5,000 bytes: over the limit
    assert invoke("run", "--engine", "fake", "--quiet", "--restart", job).exit_code == 0
    kept = log.with_name(log.name + ".1")
    assert kept.read_text() == "old night\n" * 500
    assert "old night" not in log.read_text() and log.read_text().count("==== ") == 1
    log.write_text("another night\n" * 400)
    assert invoke("run", "--engine", "fake", "--quiet", "--restart", job).exit_code == 0
    assert kept.read_text() == "another night\n" * 400  # the older .1 replaced: two logs at most
    # a command the job's lock refuses leaves the running job's log where it writes it
    log.write_text("live run\n" * 600)
    with JobLock(tmp_path / "out" / "results.sqlite", "t"):
        assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 75
    assert log.read_text().startswith("live run\n" * 600) and kept.read_text() == "another night\n" * 400


def test_a_job_lock_is_seen_held_only_while_a_process_holds_it(tmp_path):
    from runner.lock import held

    db = tmp_path / "r.sqlite"
    assert not held(db, "t")  # no lock file yet
    with JobLock(db, "t"):
        assert held(db, "t")
    assert not held(db, "t")


def test_rotating_a_log_that_is_gone_or_small_moves_nothing(tmp_path):
    from runner.console import rotate_if_large

    assert rotate_if_large(tmp_path / "none.log", 10) is None
    small = tmp_path / "small.log"
    small.write_text("x")
    assert rotate_if_large(small, 10) is None and small.read_text() == "x"
    assert rotate_if_large(small, 1) == tmp_path / "small.log.1" and not small.exists()
    elsewhere = tmp_path / "var-log" / "job.log"
    elsewhere.parent.mkdir()
    elsewhere.write_text("y" * 100)
    linked = tmp_path / "linked.log"
    linked.symlink_to(elsewhere)
    assert rotate_if_large(linked, 10) is None and linked.is_symlink()  # the user's place: left alone


def test_status_of_a_retired_job_shows_what_is_stored(make_job, tmp_path):
    """A job whose schema is gone (retired) no longer loads, but its results do: status shows the
    stored rows by version, not compared with the job, then why it does not load (exit 2: a job
    that does not load, for monitoring), as stats, export and report still read them."""
    job = make_job(rows=4)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    (tmp_path / "schemas" / "out.json").unlink()
    out = invoke("status", job)
    assert out.exit_code == 2, out.output
    lines = out.stdout.splitlines()
    assert lines[0].startswith("job t: 4 rows stored in ") and "not compared: the job does not load" in out.stdout
    assert lines[-1] == "next run: not counted: the job does not load (below)"
    assert out.stderr.startswith("Error: ") and "output_schema: file not found" in out.stderr
    (tmp_path / "out" / "results.sqlite").unlink()  # nothing stored: the error alone, as before
    out = invoke("status", job)
    assert out.exit_code == 2 and out.stdout == "" and "output_schema: file not found" in out.stderr
    broken = tmp_path / "broken.yaml"  # a job file that is not a job at all is refused as before
    broken.write_text("name: [\n")
    assert invoke("status", str(broken)).exit_code == 2


def test_a_log_linked_to_a_file_not_made_yet_is_written(make_job, tmp_path):
    """An engine log that is a link to a file not there yet (first setup, or moved away by
    logrotate) is made where the link points: validate and run accept it."""
    job = make_job(rows=2)
    (tmp_path / "out").mkdir()
    target = tmp_path / "var-log" / "job.log"
    target.parent.mkdir()
    (tmp_path / "out" / "results.sqlite.t.log").symlink_to(target)
    assert invoke("validate", job).exit_code == 0
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    assert "runner run" in target.read_text()


def test_a_killed_holders_pid_taken_by_another_process_is_not_a_holder(tmp_path):
    """A run killed with SIGKILL leaves its pid in the lock file; a later process may get that pid.
    Where the kernel lists its locks, only a process that holds the lock is named."""
    import subprocess
    import sys

    from runner.lock import flock_holders, holder, lock_path

    if flock_holders() is None:
        pytest.skip("no /proc/locks on this system")
    db = tmp_path / "r.sqlite"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock_path(db, "t").write_text(str(other.pid))  # alive, but it holds no lock
        assert holder(db, "t") is None
        with JobLock(db, "t"):
            assert holder(db, "t") == os.getpid()
    finally:
        other.kill()
        other.wait()


def test_the_kernels_lock_table_is_read_for_flock_holders_only(tmp_path):
    from runner.lock import flock_holders

    table = tmp_path / "locks"
    table.write_text("1: FLOCK  ADVISORY  WRITE 4242 fe:01:123 0 EOF\n"
                     "1: -> FLOCK  ADVISORY  WRITE 4343 fe:01:123 0 EOF\n"
                     "2: POSIX  ADVISORY  WRITE 4444 08:10:77 0 EOF\n"
                     "3: OFDLCK ADVISORY  READ  -1 00:2a:9 0 EOF\n")
    assert flock_holders(str(table)) == ({4242}, {(0xfe, 1, 123)})
    assert flock_holders(str(tmp_path / "none")) is None


def test_a_renamed_job_is_told_where_its_rows_are(make_job, tmp_path):
    """Rows are kept per job name: a job renamed in its file ran every row again with no word of the
    rows its old name holds in the same database."""
    job = make_job(rows=4)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    edit(job, lambda s: s.update(name="renamed"))
    note = (f"no row of job renamed is stored, but 4 of its 4 input rows are stored under job t in "
            f"{tmp_path / 'out' / 'results.sqlite'}, made exactly as this job makes them (renamed?): they are not "
            "reused; set `name: t` to resume them")
    assert f"Note: {note}" in invoke("status", job).output.splitlines()
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0 and note in out.output and "4 run" in out.output, out.output
    assert "renamed?" not in invoke("run", "--engine", "fake", job).output  # its own rows now
    edit(job, lambda s: s["sampling"].update(max_tokens=32) or s.update(name="other"))  # made differently: no note
    assert "renamed?" not in invoke("status", job).output
    # a job alike but for its input (another year's files): its ids are not stored elsewhere, no note
    from tests.conftest import write_docs

    write_docs(tmp_path / "data" / "2025.parquet", 4)
    t = pq.read_table(tmp_path / "data" / "2025.parquet").to_pydict()
    t["id"] = [f"y{i}" for i in range(4)]
    pq.write_table(pa.table(t), tmp_path / "data" / "2025.parquet")
    edit(job, lambda s: s["sampling"].update(max_tokens=64) or s.update(name="y2025")
         or s["input"].update(path="data/2025.parquet"))
    assert "renamed?" not in invoke("status", job).output and "renamed?" not in invoke("run", "--engine", "fake", job).output


def test_a_job_file_with_a_key_that_no_longer_validates_still_reads_its_results(make_job, tmp_path):
    """stats, export, report and prune read only the job's name and database: a typo elsewhere (or
    a key a newer runner renamed) must not lock its stored results away. A bad name or database
    still stops them, with the job file's error."""
    job = make_job(rows=4)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    typo = tmp_path / "typo.yaml"
    typo.write_text(Path(job).read_text().replace("temperature:", "temprature:"))
    assert invoke("validate", str(typo)).exit_code == 2  # as a job it does not load
    out = invoke("stats", "--job", str(typo))
    assert out.exit_code == 0 and "ok 4" in out.stdout, out.output
    out = invoke("export", "--job", str(typo), "--format", "csv", "-o", str(tmp_path / "x.csv"))
    assert out.exit_code == 0 and len((tmp_path / "x.csv").read_text().splitlines()) == 5, out.output
    assert invoke("report", "1", "--job", str(typo), "-o", str(tmp_path / "x.html")).exit_code == 0
    assert invoke("prune", str(typo), "--keep-versions", "1").exit_code == 0
    for own in ("data/docs.parquet", "schemas/out.json"):  # read key by key, its files are guarded still
        out = invoke("export", "--job", str(typo), "--format", "parquet", "-o", str(tmp_path / own))
        assert out.exit_code == 6 and "give another file" in out.output, (own, out.output)
    nameless = tmp_path / "nameless.yaml"
    nameless.write_text(Path(job).read_text().replace("temperature:", "temprature:").replace("name: t", "name: t t"))
    out = invoke("stats", "--job", str(nameless))  # what it reads is wrong: that is the error shown
    assert out.exit_code == 2 and out.stderr.startswith("Error: ") and "nameless.yaml: name: " in out.stderr, out.output
    # the output section, and whatever --set gives, stay checked: a typo there would read another database
    out = invoke("stats", "--job", job, "--set", "sampling.temprature=0")
    assert out.exit_code == 2 and "sampling.temprature: unknown key" in out.stderr, out.output
    (tmp_path / "out_typo.yaml").write_text(typo.read_text().replace("commit_every_rows:", "commit_evry_rows:"))
    out = invoke("stats", "--job", str(tmp_path / "out_typo.yaml"))
    assert out.exit_code == 2 and "output.commit_evry_rows: unknown key" in out.stderr, out.output


def test_status_with_the_model_missing_says_so_and_does_not_call_the_rows_changed(make_job, tmp_path):
    """The fingerprints hold the model's files: with the folder gone (another user's cache, a typo in
    --set) every row read as changed and due to run again. Now the rows are not compared, and the
    model's error ends it (exit 4), as validate and run stop."""
    job = make_job(rows=4)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    out = invoke("status", job, "--set", f"engine.model={tmp_path / 'gone'}")
    assert out.exit_code == 4, out.output
    assert "changed" not in out.stdout and "not compared" in out.stdout and "next run: not counted" in out.stdout
    assert out.stderr.startswith("Error: ") and "gone: model folder not found" in out.stderr
    assert invoke("validate", job, "--set", f"engine.model={tmp_path / 'gone'}").exit_code == 4
    out = invoke("status", job)
    assert out.exit_code == 0 and "current" in out.stdout and "next run: nothing to run" in out.stdout, out.output


def test_status_writes_every_count_of_a_version_with_thousands_separators(make_job):
    job = make_job(rows=1200)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    status = invoke("status", job)
    assert status.exit_code == 0 and "1,200 rows (ok 1,200)" in status.output, status.output


def test_a_changed_max_model_len_runs_again_only_the_rows_the_length_touched(make_job, tmp_path):
    """Raising engine.max_model_len ran every stored row again, though a row that fitted both lengths
    is made the same; the row that was too long runs again, and lowering it reruns what no longer fits."""
    from tests.conftest import write_docs

    docs = write_docs(tmp_path / "data" / "long.parquet", 6)
    t = pq.read_table(docs).to_pydict()
    t["text"][4] = "word " * 300  # too long for max_model_len 1024, within 2048
    pq.write_table(pa.table(t), docs)
    job = make_job(docs=docs)
    db = tmp_path / "out" / "results.sqlite"
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    assert dict(rows(db, "row_id", "status"))["r004"] == "failed"
    made = dict(rows(db, "row_id", "created_at_utc"))
    out = invoke("run", "--engine", "fake", "--set", "engine.max_model_len=2048", job)
    assert out.exit_code == 0 and "running 1 stored row again" in out.output, out.output
    assert dict(rows(db, "row_id", "status"))["r004"] == "ok"
    after = dict(rows(db, "row_id", "created_at_utc"))
    assert [r for r in made if after[r] != made[r]] == ["r004"]
    # back to 1024: the long row no longer fits (it fails again, alone); the others stay
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0 and "running 1 stored row again" in out.output, out.output
    assert dict(rows(db, "row_id", "status"))["r004"] == "failed"


def test_each_older_version_keeps_its_rows_by_its_own_length(make_job, tmp_path):
    """The room rows are kept by was the least of every length the job ever had: once run at 1024,
    a later change of on_too_long alone at 2048 ran again rows made at 2048 that fitted 2048."""
    from tests.conftest import write_docs

    docs = write_docs(tmp_path / "data" / "long.parquet", 4)
    t = pq.read_table(docs).to_pydict()
    t["text"][2] = "word " * 300  # over 1024's room, within 2048's
    pq.write_table(pa.table(t), docs)
    job = make_job(docs=docs)
    db = tmp_path / "out" / "results.sqlite"
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0  # at 1024: r002 too long
    assert invoke("run", "--engine", "fake", "--quiet", "--set", "engine.max_model_len=2048", job).exit_code == 0
    assert dict(rows(db, "row_id", "status"))["r002"] == "ok"
    made = dict(rows(db, "row_id", "created_at_utc"))
    out = invoke("run", "--engine", "fake", "--set", "engine.max_model_len=2048", "--set", "input.on_too_long=truncate", job)
    assert out.exit_code == 0 and "4 stored rows that it does not change kept" in out.output, out.output
    assert dict(rows(db, "row_id", "created_at_utc")) == made  # none ran again, r002 included
