"""The SQLite schema, as numbered migrations applied in order and recorded in `_migrations`.

Add a new `mNNN_...` function at the end of MIGRATIONS; never edit one that has shipped.
Column names carry units: *_ms, *_s, *_tokens, *_at_utc, *_json.
"""
from __future__ import annotations

import sqlite3
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import Connection, text

from runner.errors import StoreError
from runner.store_sqlite import read_uri


_M001_RUNS = """
        CREATE TABLE runs (
            id INTEGER PRIMARY KEY,
            job_name TEXT NOT NULL,
            job_path TEXT NOT NULL,
            config_json TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('running', 'completed', 'failed', 'interrupted')),
            started_at_utc TEXT NOT NULL,
            ended_at_utc TEXT,
            error TEXT,
            runner_version TEXT NOT NULL,
            engine_backend TEXT,
            engine_version TEXT,
            engine_settings_json TEXT,
            host TEXT,
            pid INTEGER
        )"""
_M001_RUNS_INDEX = "CREATE INDEX runs_job ON runs (job_name, id)"
_M001_RESULTS = """
        CREATE TABLE results (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs (id),
            job_name TEXT NOT NULL,
            row_id TEXT NOT NULL,
            group_key TEXT NOT NULL,
            status TEXT NOT NULL,
            extraction_json TEXT,
            output_text TEXT,
            error TEXT,
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            cached_prompt_tokens INTEGER NOT NULL,
            finish_reason TEXT,
            latency_ms REAL NOT NULL,
            preemptions INTEGER NOT NULL DEFAULT 0,
            attempts INTEGER NOT NULL DEFAULT 1,
            first_status TEXT,  -- status of the first attempt when the row was retried
            created_at_utc TEXT NOT NULL,
            -- One stored result per input row of a job: resume and retried deliveries upsert.
            UNIQUE (job_name, row_id)
        )"""
_M001_RESULTS_INDEX = "CREATE INDEX results_run ON results (run_id, status)"
_M001_RUN_STATS = """
        CREATE TABLE run_stats (
            run_id INTEGER PRIMARY KEY REFERENCES runs (id),
            rows_total INTEGER NOT NULL,
            rows_skipped INTEGER NOT NULL,
            rows_ok INTEGER NOT NULL,
            rows_truncated INTEGER NOT NULL,
            rows_invalid_json INTEGER NOT NULL,
            rows_schema_mismatch INTEGER NOT NULL,
            rows_failed INTEGER NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            cached_prompt_tokens INTEGER NOT NULL,
            wall_s REAL NOT NULL,
            engine_load_s REAL NOT NULL,
            generation_s REAL NOT NULL,
            documents_per_s REAL NOT NULL,
            output_tokens_per_s REAL NOT NULL,
            total_tokens_per_s REAL NOT NULL,
            prefix_cache_queries INTEGER NOT NULL,
            prefix_cache_hits INTEGER NOT NULL,
            prefix_cache_hit_rate REAL,
            plan_prefix_share REAL,
            spec_drafts INTEGER NOT NULL,
            spec_draft_tokens INTEGER NOT NULL,
            spec_accepted_tokens INTEGER NOT NULL,
            spec_acceptance_rate REAL,
            preemptions INTEGER NOT NULL,
            created_at_utc TEXT NOT NULL
        )"""


def m001_initial(conn: Connection) -> None:
    for statement in (_M001_RUNS, _M001_RUNS_INDEX, _M001_RESULTS, _M001_RESULTS_INDEX, _M001_RUN_STATS):
        conn.exec_driver_sql(statement)


def m002_engine_choice(conn: Connection) -> None:
    # What the run chose and adapted: speculative calibration, KV admission per engine.
    conn.exec_driver_sql("ALTER TABLE run_stats ADD COLUMN engine_choice_json TEXT")


def m003_run_samples(conn: Connection) -> None:
    # Throughput over time, one row every few seconds of a run, for reports.
    conn.exec_driver_sql("""
        CREATE TABLE run_samples (
            run_id INTEGER NOT NULL REFERENCES runs (id),
            elapsed_s REAL NOT NULL,
            rows_done INTEGER NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            cached_prompt_tokens INTEGER NOT NULL,
            PRIMARY KEY (run_id, elapsed_s)
        )""")


def m004_calibrations(conn: Connection) -> None:
    # Speculative-decoding choices, measured once and reused while their key holds (see
    # runner/fingerprint.py): a nightly job pays for calibration on its first night only.
    conn.exec_driver_sql("""
        CREATE TABLE calibrations (
            id INTEGER PRIMARY KEY,
            key_sha256 TEXT NOT NULL,
            key_json TEXT NOT NULL,
            job_name TEXT NOT NULL,
            run_id INTEGER,  -- the run that measured it; NULL for `runner calibrate`
            chosen_draft_tokens INTEGER NOT NULL,
            speculative_json TEXT,  -- vLLM's speculative_config to run with; NULL: no drafts
            kv_total_blocks INTEGER,  -- the engine's KV cache when measured; a different one measures again
            engine_start_s REAL,
            record_json TEXT NOT NULL,
            created_at_utc TEXT NOT NULL
        )""")
    conn.exec_driver_sql("CREATE INDEX calibrations_key ON calibrations (key_sha256, id)")


def m005_fingerprints(conn: Connection) -> None:
    # What produced each result (runner/fingerprint.py), so that a run redoes rows made by an older
    # version of the job; the rows it replaces go to results_history, nothing is lost.
    conn.exec_driver_sql("ALTER TABLE results ADD COLUMN fingerprint TEXT")  # NULL: made before fingerprints
    conn.exec_driver_sql("""
        CREATE TABLE fingerprints (
            fingerprint TEXT NOT NULL,
            job_name TEXT NOT NULL,
            components_json TEXT NOT NULL,  -- model, prompts, schema, sampling... that it hashes
            created_at_utc TEXT NOT NULL,
            PRIMARY KEY (job_name, fingerprint)
        )""")
    # The columns of results as they are now (id: the row it was); a later migration that adds a
    # column to results adds it here too.
    conn.exec_driver_sql("CREATE TABLE results_history AS SELECT * FROM results WHERE 0")
    conn.exec_driver_sql("ALTER TABLE results_history ADD COLUMN replaced_at_utc TEXT")
    conn.exec_driver_sql("ALTER TABLE results_history ADD COLUMN replaced_by_run_id INTEGER")
    conn.exec_driver_sql("CREATE INDEX results_history_row ON results_history (job_name, row_id)")
    conn.exec_driver_sql("ALTER TABLE run_stats ADD COLUMN rows_redone INTEGER NOT NULL DEFAULT 0")
    conn.exec_driver_sql("ALTER TABLE runs ADD COLUMN log_path TEXT")  # where vLLM's and torch's output went


def m006_verifications_and_drafts(conn: Connection) -> None:
    # `runner verify`: how many greedy outputs a speculative setting left unchanged; `runner
    # distill`: draft models made from a job's own outputs.
    conn.exec_driver_sql("""
        CREATE TABLE verifications (
            id INTEGER PRIMARY KEY,
            key_sha256 TEXT NOT NULL,  -- the calibration key (model, engine, schema, prompts...)
            setting_json TEXT NOT NULL,  -- the speculative method and its draft, without the length
            job_name TEXT NOT NULL,
            rows INTEGER NOT NULL,
            agreement REAL NOT NULL,  -- share of rows whose output was the same with and without drafts
            field_agreement_json TEXT NOT NULL,  -- per top-level field of the extraction
            differences_json TEXT NOT NULL,  -- the rows that differ, side by side (the first 20)
            created_at_utc TEXT NOT NULL
        )""")
    conn.exec_driver_sql("CREATE INDEX verifications_key ON verifications (key_sha256, setting_json, id)")
    conn.exec_driver_sql("""
        CREATE TABLE drafts (
            id INTEGER PRIMARY KEY,
            job_name TEXT NOT NULL,
            path TEXT NOT NULL,
            base_model TEXT NOT NULL,
            base_model_fingerprint TEXT NOT NULL,
            layers INTEGER NOT NULL,
            rows_trained INTEGER NOT NULL,
            rows_held_out INTEGER NOT NULL,
            train_json TEXT NOT NULL,  -- epochs, learning rate, losses, held-out acceptance by position
            created_at_utc TEXT NOT NULL
        )""")


def m007_output_token_ids(conn: Connection) -> None:
    # The token ids the model generated: what a distilled draft must learn to guess. Under a JSON
    # grammar they differ from the text's own tokenization from the first token on.
    for table in ("results", "results_history"):
        conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN output_token_ids_json TEXT")


def m008_rejected_rows(conn: Connection) -> None:
    # input.on_bad_row: store: rows that cannot be results (no id, or an id seen before), kept
    # with the run that met them so that a night's bad input can be found and fixed.
    conn.exec_driver_sql("""
        CREATE TABLE rejected_rows (
            id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL REFERENCES runs(id),
            job_name TEXT NOT NULL,
            input_row_number INTEGER NOT NULL,  -- 0-based, in the input's reading order
            row_id TEXT,
            reason TEXT NOT NULL
        )""")
    # runner verify --baseline: the share of rows two runs without drafts agree on. Where the
    # engine's own numerics vary with the batch (bf16 on a GPU), that share is below 1 and a
    # setting is judged against it, not against 1.
    conn.exec_driver_sql("ALTER TABLE verifications ADD COLUMN baseline_agreement REAL")


def m009_verification_discordant_rows(conn: Connection) -> None:
    # runner verify --baseline, row by row: rows that only the drafts changed (the two runs without
    # drafts agree, the run with drafts differs) and rows that only the engine changed (the runs
    # without drafts differ, the run with drafts matches the first). The gate's sign test reads these.
    conn.exec_driver_sql("ALTER TABLE verifications ADD COLUMN rows_changed_by_drafts_only INTEGER")
    conn.exec_driver_sql("ALTER TABLE verifications ADD COLUMN rows_changed_by_engine_only INTEGER")


def m010_history_by_run(conn: Connection) -> None:
    # `runner export RUN`, `report RUN` and `stats RUN` read a run's replaced rows back from
    # results_history: found by run, not by scanning the whole history.
    conn.exec_driver_sql("CREATE INDEX results_history_run ON results_history (run_id, status)")


def m011_samples_failed_rows(conn: Connection) -> None:
    # The report's documents/s over time counts the rows generated, as the run's documents_per_s
    # does: failed rows (never generated) are stored at once and made the curve spike. Samples from
    # before have 0.
    conn.exec_driver_sql("ALTER TABLE run_samples ADD COLUMN rows_failed INTEGER NOT NULL DEFAULT 0")


def m012_document_tokens_cut(conn: Connection) -> None:
    # input.on_too_long: truncate cuts a document to fit max_model_len: its result says by how many
    # tokens, so that an extraction made from part of a document can be told from the others.
    for table in ("results", "results_history"):
        conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN document_tokens_cut INTEGER")


def m013_verification_settings(conn: Connection) -> None:
    # What a verification ran with besides its key (scheduling, sampling, the GPUs seen): a failure
    # is lifted only by a later pass made with the same. NULL for verifications made before.
    conn.exec_driver_sql("ALTER TABLE verifications ADD COLUMN settings_sha256 TEXT")


def m014_set_aside(conn: Connection) -> None:
    # --restart marks the job's rows to be run again (when), where it moved them all to
    # results_history at once: a stopped restart left every row it had not reached out of results
    # and out of `export --job`. Each now moves as its new result is stored.
    for table in ("results", "results_history"):
        conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN set_aside_at_utc TEXT")


MIGRATIONS = [m001_initial, m002_engine_choice, m003_run_samples, m004_calibrations, m005_fingerprints,
              m006_verifications_and_drafts, m007_output_token_ids, m008_rejected_rows,
              m009_verification_discordant_rows, m010_history_by_run, m011_samples_failed_rows,
              m012_document_tokens_cut, m013_verification_settings, m014_set_aside]


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def migrate(conn: Connection) -> list[str]:
    """Apply the migrations this database lacks, in order. Returns the names applied."""
    conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at_utc TEXT NOT NULL)")
    done = {r[0] for r in conn.exec_driver_sql("SELECT name FROM _migrations")}
    if not done and conn.exec_driver_sql("SELECT 1 FROM sqlite_master WHERE name = 'runs'").first():
        # Made by a runner before 0.2, whose migrations committed one by one, and killed midway.
        raise StoreError("tables exist but no migration was recorded: the file was left half-made by an "
                         "interrupted first run of an older runner; move it away and run again")
    refuse_newer(done)
    applied = []
    for fn in MIGRATIONS:
        if fn.__name__ in done:
            continue
        fn(conn)
        conn.execute(text("INSERT INTO _migrations (name, applied_at_utc) VALUES (:n, :t)"),
                     {"n": fn.__name__, "t": utc_now()})
        applied.append(fn.__name__)
    return applied


def refuse_newer(done: set[str]) -> None:
    """StoreError where the database records a migration this runner does not know: a newer runner
    made or upgraded it, and writing to it with this one could store rows its readers misread."""
    unknown = sorted(done - {fn.__name__ for fn in MIGRATIONS})
    if unknown:
        from runner import __version__

        raise StoreError(f"made by a newer runner (its migration {unknown[-1]} is unknown to runner {__version__}): "
                         "upgrade the runner to use this database")


def pending_migrations(path: Path) -> list[str]:
    """The migrations the database at path lacks, read without writing to it (none where it cannot
    be read: opening it then says why)."""
    try:
        con = sqlite3.connect(read_uri(path), uri=True)
        try:
            done = {r[0] for r in con.execute("SELECT name FROM _migrations")}
        finally:
            con.close()
    except sqlite3.Error:
        return []
    refuse_newer(done)
    return [fn.__name__ for fn in MIGRATIONS if fn.__name__ not in done]
