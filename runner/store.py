"""Runs, results and stats in one SQLite file, through SQLAlchemy 2.0 Core.

Tables come from the migrations (reflected, so the schema is written once). SQLite runs in WAL
mode with synchronous=NORMAL and a busy timeout (runner/store_sqlite.py); each commit batch is one
transaction, so a kill loses at most the batch in flight. The database must be on a local disk
(WAL needs shared memory).
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from sqlalchemy import MetaData, func, select, union_all, update
from sqlalchemy.dialects.sqlite import insert
from sqlalchemy.exc import SQLAlchemyError

from runner import __version__
from runner.errors import StoreError
from runner.migrations import migrate, pending_migrations, utc_now
from runner.rows import RESULT_COLUMNS, STATUSES, ResultRow, StatsRow
from runner.store_history import HistoryRecords
from runner.store_input import InputRecords
from runner.store_speculation import SpeculationRecords
from runner.store_sqlite import (DoneFilter, Transaction, check_unchanged, named, refuse_damaged, refuse_foreign,
                                 short_error, sqlite_engine)

_UPSERT_RESULTS = (f"INSERT INTO results ({', '.join(RESULT_COLUMNS)}) VALUES ({', '.join('?' * len(RESULT_COLUMNS))}) "
                   f"ON CONFLICT (job_name, row_id) DO UPDATE SET "
                   + ", ".join(f"{c} = excluded.{c}" for c in RESULT_COLUMNS if c not in ("job_name", "row_id"))
                   + ", set_aside_at_utc = NULL")  # run again after --restart: done

_TABLES = ("runs", "results", "run_stats", "run_samples", "calibrations", "fingerprints", "results_history",
           "verifications", "drafts")


class Store(SpeculationRecords, HistoryRecords, InputRecords):
    """One SQLite results database."""

    def __init__(self, path: Path | str, read_only: bool = False):
        """`read_only`: for commands that only read a database whose migrations are all applied
        (Store.for_reading): it may then sit in a read-only folder."""
        self.path = Path(path)
        self.read_only = read_only
        refuse_foreign(self.path)  # before the first connection, which would switch it to WAL
        self._seen: Optional[tuple] = None
        try:
            self.engine, self._seen = sqlite_engine(self.path, read_only)
            if not read_only:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # One IMMEDIATE transaction takes the write lock first: every migration lands or none
                # does (a kill or a full disk leaves no half-made schema), and two processes creating
                # the same file take turns.
                with self.engine.connect() as conn:
                    conn.execution_options(sqlite_begin="BEGIN IMMEDIATE")
                    with conn.begin():
                        migrate(conn)
            meta = MetaData()
            meta.reflect(bind=self.engine)
        except (SQLAlchemyError, OSError) as exc:
            self.check_unchanged()  # a read without locks that a run wrote under: not a file that will not open
            raise StoreError(f"{self.path}: cannot open the results database: {short_error(exc)}") from None
        except StoreError as exc:  # named here unless the message names the file already
            self.check_unchanged()
            raise named(self.path, exc) from None
        missing = [t for t in _TABLES if t not in meta.tables]
        if missing:  # every migration is recorded, yet a table is gone: dropped by hand, or damage
            self.check_unchanged()
            raise StoreError(f"{self.path}: the results database is damaged (its table {missing[0]} is missing): "
                             "restore it from a backup or move it away")
        self.runs = meta.tables["runs"]
        self.results = meta.tables["results"]
        self.run_stats = meta.tables["run_stats"]
        self.run_samples = meta.tables["run_samples"]
        self.calibrations = meta.tables["calibrations"]
        self.fingerprints = meta.tables["fingerprints"]
        self.history = meta.tables["results_history"]
        self.verifications = meta.tables["verifications"]
        self.drafts = meta.tables["drafts"]

    @classmethod
    def for_reading(cls, path: Path | str) -> "Store":
        """A Store for commands that only read. Read-only where the file or its folder cannot be
        written (a read-only mount, a backup share, another user's file); a file that lacks a
        migration (an older runner's) cannot be read there. Elsewhere a writable Store, which
        upgrades an older file, and whose last connection folds the write-ahead log into the file."""
        path = Path(path)
        if os.access(path.parent, os.W_OK) and os.access(path, os.W_OK):
            return cls(path)
        try:
            pending = pending_migrations(path)
        except StoreError as exc:
            raise named(path, exc) from None
        if pending:
            raise StoreError(f"{path}: made by an older runner, it needs its migration {pending[0]} to be read, "
                             "and this user cannot write it here: copy it to a folder you can write, or run any "
                             "runner command on it as the user who runs the job")
        return cls(path, read_only=True)

    def close(self) -> None:
        self.engine.dispose()

    def check_unchanged(self) -> None:
        """ChangedWhileRead where this reading Store had no locks (another user's file, a read-only
        folder) and a run has written to the file since it opened: what was read may be mixed."""
        check_unchanged(self.path, self._seen)

    def check_integrity(self) -> None:
        """PRAGMA quick_check: refuse a damaged file (a broken unique index would store rows twice)."""
        with self.engine.connect() as conn:
            refuse_damaged(self.path, [r[0] for r in conn.exec_driver_sql("PRAGMA quick_check")])

    # -- runs -------------------------------------------------------------------------------
    def begin_run(self, job_name: str, job_path: str, config: dict, log_path: Optional[str] = None) -> int:
        # not key-sorted: the output schema's properties keep their order, the export's column order
        values = dict(job_name=job_name, job_path=job_path, config_json=json.dumps(config),
                      status="running", started_at_utc=utc_now(), runner_version=__version__,
                      host=socket.gethostname(), pid=os.getpid(), log_path=log_path)
        with self._tx() as conn:
            return conn.execute(self.runs.insert().values(**values)).inserted_primary_key[0]

    def set_engine(self, run_id: int, backend: str, version: str, settings: dict) -> None:
        with self._tx() as conn:
            conn.execute(update(self.runs).where(self.runs.c.id == run_id).values(
                engine_backend=backend, engine_version=version,
                engine_settings_json=json.dumps(settings, sort_keys=True, default=str)))

    def finish_run(self, run_id: int, status: str, stats: Optional[StatsRow] = None, error: Optional[str] = None,
                   if_running: bool = False) -> bool:
        """Close a run, and write its stats row in the same transaction. if_running: only a run
        still `running` (how a stopped or failed run ends: a stop that arrived just after the run
        completed must not turn it into an interrupted one with a second stats row). Returns
        whether the row was closed."""
        with self._tx() as conn:
            q = update(self.runs).where(self.runs.c.id == run_id)
            if if_running:
                q = q.where(self.runs.c.status == "running")
            closed = conn.execute(q.values(status=status, ended_at_utc=utc_now(), error=error)).rowcount
            if closed and stats is not None:
                conn.execute(self.run_stats.insert().values(run_id=run_id, created_at_utc=utc_now(), **stats.as_dict()))
        return bool(closed)

    def mark_abandoned_runs(self, job_name: str) -> int:
        """Runs still 'running' when a new one starts under the lock died: mark them interrupted,
        ended at their last stored row (or their start), not when the next run noticed."""
        last_row = select(func.max(self.results.c.created_at_utc)).where(
            self.results.c.run_id == self.runs.c.id).scalar_subquery()
        with self._tx() as conn:
            return conn.execute(update(self.runs).where(
                self.runs.c.job_name == job_name, self.runs.c.status == "running"
            ).values(status="interrupted", ended_at_utc=func.coalesce(last_row, self.runs.c.started_at_utc),
                     error="process ended before the run finished (ended_at_utc: its last stored row, or its start)")).rowcount

    # -- results ----------------------------------------------------------------------------
    def done_row_ids(self, job_name: str, fingerprint: Optional[str] = None, ok_only: bool = False) -> set[str]:
        """Rows a run skips: made by this fingerprint (or before fingerprints existed), or with
        `ok_only` (--retry-failed) every row whose status is ok, whatever made it."""
        r = self.results.c
        q = select(r.row_id).where(r.job_name == job_name, r.set_aside_at_utc.is_(None))  # not those --restart marked
        if ok_only:
            q = q.where(r.status == "ok")
        elif fingerprint is not None:
            q = q.where((r.fingerprint == fingerprint) | r.fingerprint.is_(None))
        with self.engine.connect() as conn:
            return set(conn.execute(q).scalars())

    def done_filter(self, job_name: str, fingerprint: str, ok_only: bool = False) -> "DoneFilter":
        return DoneFilter(self.path, job_name, fingerprint, ok_only)

    def register_fingerprint(self, job_name: str, fingerprint: str, components: dict) -> None:
        stmt = insert(self.fingerprints).on_conflict_do_nothing()
        with self._tx() as conn:
            conn.execute(stmt, dict(job_name=job_name, fingerprint=fingerprint, created_at_utc=utc_now(),
                                    components_json=json.dumps(components, sort_keys=True, default=str)))

    def fingerprint_components(self, job_name: str) -> dict[str, dict]:
        f = self.fingerprints.c
        with self.engine.connect() as conn:
            return {fp: json.loads(c) for fp, c in conn.execute(
                select(f.fingerprint, f.components_json).where(f.job_name == job_name))}

    def rows_by_fingerprint(self, job_name: str) -> list[dict]:
        """Per fingerprint: rows by status, when they were made, and how many --restart set aside."""
        r = self.results.c
        q = select(r.fingerprint, r.status, func.count(), func.min(r.created_at_utc), func.max(r.created_at_utc),
                   func.count(r.set_aside_at_utc)).where(r.job_name == job_name).group_by(r.fingerprint, r.status)
        out: dict = {}
        with self.engine.connect() as conn:
            for fp, status, n, first, last, aside in conn.execute(q):
                e = out.setdefault(fp, {"fingerprint": fp, "rows": 0, "statuses": {}, "first_at_utc": first,
                                        "last_at_utc": last, "set_aside": 0})
                e["rows"] += n
                e["set_aside"] += aside
                e["statuses"][status] = n
                e["first_at_utc"], e["last_at_utc"] = min(e["first_at_utc"], first), max(e["last_at_utc"], last)
            history = conn.execute(select(func.count()).select_from(self.history)
                                   .where(self.history.c.job_name == job_name)).scalar()
        return sorted(out.values(), key=lambda e: e["last_at_utc"], reverse=True) + [{"history_rows": history}]

    def write_results(self, rows: list[ResultRow], samples: Optional[list[dict[str, Any]]] = None) -> None:
        """Upsert a batch of result rows, and any throughput samples, in one transaction. A row that
        replaces a stored one (a changed job, --retry-failed) moves the old one to results_history."""
        if not rows and not samples:
            return
        now = utc_now()
        with self._tx() as conn:
            if rows:
                self._archive(conn, rows, now)
                # The driver's executemany with one SQL string: SQLAlchemy's per-row parameter
                # processing cost more than SQLite's insert (bench/scale.py).
                conn.exec_driver_sql(_UPSERT_RESULTS, [r.values(now) for r in rows])
            if samples:
                conn.execute(insert(self.run_samples).on_conflict_do_nothing(), samples)

    def save_rejected(self, run_id: int, job_name: str, rows: list[tuple[int, Optional[str], str]]) -> None:
        """Input rows a run left out (input.on_bad_row: store): (row number, id, reason). The
        job's latest list replaces the one before: the input is read whole by every run."""
        with self._tx() as conn:
            conn.exec_driver_sql("DELETE FROM rejected_rows WHERE job_name = ?", (job_name,))
            conn.exec_driver_sql(
                "INSERT INTO rejected_rows (run_id, job_name, input_row_number, row_id, reason) VALUES (?, ?, ?, ?, ?)",
                [(run_id, job_name, n, rid, why) for n, rid, why in rows])

    def ok_results(self, job_name: str, fingerprint: Optional[str] = None) -> Iterable[tuple[str, str, Optional[str]]]:
        """(row id, output text, generated token ids as JSON) of the job's ok rows (of one
        fingerprint, or made before fingerprints), in row order."""
        r = self.results.c
        q = select(r.row_id, r.output_text, r.output_token_ids_json).where(
            r.job_name == job_name, r.status == "ok", r.set_aside_at_utc.is_(None))  # not rows --restart will redo
        q = q.where(r.fingerprint == fingerprint if fingerprint is not None else r.fingerprint.is_(None))
        with self.engine.connect() as conn:
            yield from conn.execute(q.order_by(r.row_id))

    # -- reading ----------------------------------------------------------------------------
    def run(self, run_id: int) -> Optional[dict]:
        with self.engine.connect() as conn:
            row = conn.execute(select(self.runs).where(self.runs.c.id == run_id)).mappings().first()
            return dict(row) if row else None

    def latest_runs(self, job_name: Optional[str] = None, limit: int = 1, with_idle: bool = True) -> list[dict]:
        """The newest runs first; with_idle False leaves out those that completed with nothing to do
        (every row already stored: a nightly rerun), whose zero throughput would hide the last real one."""
        q = select(self.runs).order_by(self.runs.c.id.desc()).limit(limit)
        if job_name:
            q = q.where(self.runs.c.job_name == job_name)
        if not with_idle:
            idle = select(self.run_stats.c.run_id).where(self.run_stats.c.rows_total == 0)
            q = q.where(~((self.runs.c.status == "completed") & self.runs.c.id.in_(idle)))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def stats(self, run_id: int) -> Optional[dict]:
        with self.engine.connect() as conn:
            row = conn.execute(select(self.run_stats).where(self.run_stats.c.run_id == run_id)).mappings().first()
            return dict(row) if row else None

    def rows_replaced_by(self, run_id: int) -> int:
        """Stored rows that run_id made again (moved to results_history when it stored its own)."""
        q = select(func.count()).select_from(self.history).where(self.history.c.replaced_by_run_id == run_id)
        with self.engine.connect() as conn:
            return conn.execute(q).scalar()

    def result_counts(self, run_id: int) -> tuple[dict[str, int], int]:
        """A run's rows by status, those a later run replaced included (as export and report show
        them), and how many of the rows its stats counted are kept nowhere now: replaced, then
        deleted (`runner prune`; before results_history existed, --restart). Where some are gone,
        the rows by status are the run's own count."""
        stored, stats = self._stored_counts(run_id), self.stats(run_id)
        gone = max(0, stats["rows_total"] - sum(stored.values())) if stats else 0
        return ({s: stats[f"rows_{s}"] for s in STATUSES if stats[f"rows_{s}"]} if gone else stored), gone

    def _stored_counts(self, run_id: int) -> dict[str, int]:
        out: dict[str, int] = {}
        with self.engine.connect() as conn:
            for table in (self.results, self.history):
                q = select(table.c.status, func.count()).where(table.c.run_id == run_id).group_by(table.c.status)
                for status, n in conn.execute(q):
                    out[status] = out.get(status, 0) + n
        return out

    def samples(self, run_id: int) -> list[dict]:
        q = select(self.run_samples).where(self.run_samples.c.run_id == run_id).order_by(self.run_samples.c.elapsed_s)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def result_runs(self, job_name: str) -> list[dict]:
        """The runs that made the job's stored rows (`results`), newest first."""
        made = select(self.results.c.run_id).where(self.results.c.job_name == job_name).distinct()
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(select(self.runs).where(self.runs.c.id.in_(made))
                                                  .order_by(self.runs.c.id.desc())).mappings()]

    def results_of(self, run_id: Optional[int] = None, job_name: Optional[str] = None,
                   columns: Optional[Sequence[str]] = None) -> Iterable[dict]:
        """A run's results, those a later run replaced included (from results_history), or a job's
        (its latest result for each row, whichever run made it), one at a time; `columns`: only these."""
        names = ["id", *(c for c in columns if c != "id")] if columns else list(self.results.c.keys())
        if job_name is not None:
            q = select(*[self.results.c[c] for c in names]).where(self.results.c.job_name == job_name) \
                .order_by(self.results.c.id)
        else:  # in the order the run stored them: a replaced row keeps its id in results_history
            q = union_all(select(*[self.results.c[c] for c in names]).where(self.results.c.run_id == run_id),
                          select(*[self.history.c[c] for c in names]).where(self.history.c.run_id == run_id))
            q = q.order_by(q.selected_columns.id)
        with self.engine.connect() as conn:
            for r in conn.execute(q).mappings():
                yield dict(r)

    def _tx(self) -> Transaction:
        return Transaction(self.engine, self.path)
