"""The SQLite store on real files: migrations, WAL settings, upserts and run records."""
from __future__ import annotations

import sqlite3

import pytest

from runner.errors import StoreError
from runner.migrations import MIGRATIONS
from runner.rows import ResultRow, StatsRow
from runner.store import Store


def row(run_id, row_id, status="ok", **kw):
    return ResultRow(**dict(run_id=run_id, job_name="j", row_id=row_id, group_key="g", status=status,
                            extraction_json='{"a": 1}', output_text='{"a": 1}', error=None, prompt_tokens=10,
                            completion_tokens=5, cached_prompt_tokens=0, finish_reason="stop", latency_ms=1.5,
                            preemptions=0, attempts=1, first_status=None, fingerprint="f1") | kw)


def test_migrations_run_once_and_are_recorded(tmp_path):
    db = tmp_path / "r.sqlite"
    Store(db).close()
    Store(db).close()  # reopening applies nothing twice
    con = sqlite3.connect(db)
    names = [r[0] for r in con.execute("SELECT name FROM _migrations ORDER BY name")]
    assert names == [m.__name__ for m in MIGRATIONS]
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "results", "run_stats"} <= tables
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_connections_use_normal_sync_and_busy_timeout(tmp_path):
    s = Store(tmp_path / "r.sqlite")
    with s.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


def test_results_upsert_on_job_and_row_id(tmp_path):
    s = Store(tmp_path / "r.sqlite")
    run1 = s.begin_run("j", "/j.yaml", {"k": 1})
    s.write_results([row(run1, "a"), row(run1, "b", status="truncated")])
    run2 = s.begin_run("j", "/j.yaml", {"k": 1})
    s.write_results([row(run2, "b", status="ok", attempts=2, first_status="truncated")])
    con = sqlite3.connect(tmp_path / "r.sqlite")
    got = con.execute("SELECT row_id, run_id, status, attempts, first_status FROM results ORDER BY row_id").fetchall()
    assert got == [("a", run1, "ok", 1, None), ("b", run2, "ok", 2, "truncated")]
    assert s.done_row_ids("j") == {"a", "b"}
    assert s.done_row_ids("other") == set()


def test_unique_key_is_in_the_database_not_only_in_code(tmp_path):
    s = Store(tmp_path / "r.sqlite")
    run = s.begin_run("j", "/j.yaml", {})
    s.write_results([row(run, "a")])
    con = sqlite3.connect(tmp_path / "r.sqlite")
    with pytest.raises(sqlite3.IntegrityError):
        con.execute("INSERT INTO results (run_id, job_name, row_id, group_key, status, prompt_tokens, "
                    "completion_tokens, cached_prompt_tokens, latency_ms, created_at_utc) "
                    "VALUES (?, 'j', 'a', 'g', 'ok', 1, 1, 0, 1, 'now')", (run,))


def test_run_lifecycle_and_stats(tmp_path):
    from runner.engines.base import EngineCounters

    s = Store(tmp_path / "r.sqlite")
    run = s.begin_run("j", "/j.yaml", {"x": 1})
    s.set_engine(run, "fake", "0", {"max_num_seqs": 4})
    counts = {"ok": 3, "truncated": 1, "invalid_json": 0, "schema_mismatch": 0, "failed": 0}
    used = EngineCounters(prefix_cache_queries=100, prefix_cache_hits=60, spec_draft_tokens=10, spec_accepted_tokens=7)
    stats = StatsRow.build(counts, {"prompt": 100, "completion": 40, "cached": 60}, used, wall_s=10.0, load_s=2.0,
                           gen_s=8.0, plan_share=0.7, skipped=5, redone=0)
    s.finish_run(run, "completed", stats=stats)
    r = s.run(run)
    assert r["status"] == "completed" and r["ended_at_utc"] and r["engine_backend"] == "fake"
    st = s.stats(run)
    assert st["documents_per_s"] == 4 / 8.0 and st["prefix_cache_hit_rate"] == 0.6
    assert st["spec_acceptance_rate"] == 0.7 and st["rows_skipped"] == 5 and st["total_tokens_per_s"] == 140 / 8
    assert [x["id"] for x in s.latest_runs("j", 5)] == [run]


def test_documents_per_second_counts_only_the_rows_that_were_generated():
    from runner.engines.base import EngineCounters
    from runner.rows import StatsRow

    def docs_per_s(counts):
        return StatsRow.build(counts, {"prompt": 10, "completion": 4, "cached": 0}, EngineCounters(), wall_s=3.0,
                              load_s=1.0, gen_s=2.0, plan_share=None, skipped=0, redone=0).documents_per_s

    assert docs_per_s({"ok": 3, "schema_mismatch": 1, "failed": 2}) == 4 / 2.0  # rejected rows are not speed
    assert docs_per_s({"failed": 6}) == 0.0  # vLLM rejected every row: nothing was generated


def test_abandoned_runs_are_marked_interrupted_at_their_last_stored_row(tmp_path):
    s = Store(tmp_path / "r.sqlite")
    run = s.begin_run("j", "/j.yaml", {})
    other = s.begin_run("k", "/k.yaml", {})
    con = sqlite3.connect(tmp_path / "r.sqlite")
    started = con.execute("SELECT started_at_utc FROM runs WHERE id = ?", (run,)).fetchone()[0]
    assert s.mark_abandoned_runs("j") == 1
    r = s.run(run)
    assert r["status"] == "interrupted" and r["ended_at_utc"] == started  # it stored nothing
    assert s.run(other)["status"] == "running"  # another job's run is not this one's to close
    # a killed run that stored rows ended when it stored its last one, not when the next run looked
    run2 = s.begin_run("j", "/j.yaml", {})
    for i, at in enumerate(["2030-01-01T00:00:01.000+00:00", "2030-01-01T00:00:09.000+00:00"]):
        con.execute("INSERT INTO results (job_name, row_id, group_key, run_id, status, prompt_tokens, completion_tokens, "
                    "cached_prompt_tokens, latency_ms, created_at_utc) VALUES ('j', ?, 'g', ?, 'ok', 1, 1, 0, 1, ?)",
                    (f"r{i}", run2, at))
    con.commit()
    assert s.mark_abandoned_runs("j") == 1
    assert s.run(run2)["ended_at_utc"] == "2030-01-01T00:00:09.000+00:00"


def test_unopenable_database_is_a_store_error(tmp_path):
    (tmp_path / "dir.sqlite").mkdir()
    with pytest.raises(StoreError, match="dir.sqlite: cannot open the results database"):
        Store(tmp_path / "dir.sqlite")
    (tmp_path / "junk.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="junk.sqlite"):
        Store(tmp_path / "junk.sqlite")


def test_a_database_of_the_first_schema_is_upgraded_and_its_rows_kept(make_job, tmp_path):
    """A results file written by the first release (only m001) opens with every later migration
    applied in one go; its rows stay, count as done (no fingerprint: made before fingerprints)."""
    from sqlalchemy import create_engine

    from runner.migrations import utc_now
    from runner.run import run_job
    from runner.spec import load_job
    from runner.engines.fake import FakeEngine
    from tests.conftest import SCHEMA

    job = load_job(make_job(rows=3))
    job.database_path.parent.mkdir(parents=True)
    old = create_engine(f"sqlite:///{job.database_path}")
    with old.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at_utc TEXT NOT NULL)")
        MIGRATIONS[0](conn)
        conn.exec_driver_sql("INSERT INTO _migrations VALUES ('m001_initial', ?)", (utc_now(),))
        conn.exec_driver_sql("INSERT INTO runs (job_name, job_path, config_json, status, started_at_utc, runner_version)"
                             " VALUES ('t', 'j.yaml', '{}', 'completed', ?, '0.1.0')", (utc_now(),))
        conn.exec_driver_sql(
            "INSERT INTO results (run_id, job_name, row_id, group_key, status, extraction_json, prompt_tokens, "
            "completion_tokens, cached_prompt_tokens, latency_ms, created_at_utc) "
            "VALUES (1, 't', 'r000', 'g', 'ok', '{\"summary\": \"old\", \"sentiment\": \"neutral\"}', 5, 5, 0, 1, ?)",
            (utc_now(),))
    old.dispose()
    seen = FakeEngine(SCHEMA)
    s = run_job(job, engine_factory=lambda j: seen)
    assert s.rows_skipped == 1 and sorted(r.row_id for r in seen.seen) == ["r001", "r002"]
    con = sqlite3.connect(job.database_path)
    assert [r[0] for r in con.execute("SELECT name FROM _migrations ORDER BY name")] == [m.__name__ for m in MIGRATIONS]
    kept = con.execute("SELECT extraction_json, fingerprint FROM results WHERE row_id = 'r000'").fetchone()
    assert kept == ('{"summary": "old", "sentiment": "neutral"}', None)


def test_a_closed_done_filter_refuses_instead_of_opening_the_database_again(tmp_path):
    """A reading thread that outlives its run must not reconnect to the database after the run closed the filter."""
    import pytest

    from runner.store_sqlite import DoneFilter

    store = Store(tmp_path / "r.sqlite")
    f = DoneFilter(store.path, "job", "fp", ok_only=False)
    assert f(["a"]) == set()
    f.close()
    with pytest.raises(RuntimeError):
        f(["a"])
    store.close()
