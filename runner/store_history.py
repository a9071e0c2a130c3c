"""A job's replaced rows: what a batch replaces, --restart's set-aside and `runner prune`, all in
results_history. A part of Store."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from runner.errors import StoreError
from runner.migrations import utc_now
from runner.rows import RESULT_COLUMNS, ResultRow
from runner.store_sqlite import BUSY_TIMEOUT_MS, DoneFilter

# A job's stored rows into results_history, with when and by which run they were replaced (NULL:
# --restart moved them, no longer in the input); _archive narrows it to the rows a batch replaces.
_TO_HISTORY = (f"INSERT INTO results_history (id, {', '.join(RESULT_COLUMNS)}, set_aside_at_utc, replaced_at_utc, "
               f"replaced_by_run_id) SELECT id, {', '.join(RESULT_COLUMNS)}, set_aside_at_utc, ?, ? FROM results "
               "WHERE job_name = ?")


# A document cut to fit leaves its prompt within a few tokens of the room (fit()'s 8 tokens of
# slack, and re-tokenizing): of a row stored before document_tokens_cut existed (migration 12),
# that alone tells whether it may have been cut.
CUT_SLACK_TOKENS = 16


def uncut_within(table: str) -> str:
    """SQL: the row's document was not cut and its prompt fitted the room (parameters: the room,
    CUT_SLACK_TOKENS): a row input.on_too_long cannot have touched."""
    return (f"coalesce({table}.document_tokens_cut, 0) = 0 AND {table}.prompt_tokens <= ? - CASE WHEN "
            f"{table}.created_at_utc >= coalesce((SELECT applied_at_utc FROM _migrations WHERE name = "
            "'m012_document_tokens_cut'), '') THEN 0 ELSE ? END")


class HistoryRecords:
    """Store's methods that move rows into results_history and delete them from it."""

    def adopt_uncut_rows(self, job_name: str, old: str, new: str, room: int) -> int:
        """Give the job's rows of fingerprint `old` that input.on_too_long cannot have touched (see
        uncut_within) the fingerprint `new`. Returns how many. Read first: once adopted, the old
        fingerprint stays known, and a write transaction on every later run would hold the file."""
        with self.engine.connect() as conn:
            if not conn.exec_driver_sql("SELECT 1 FROM results WHERE job_name = ? AND fingerprint = ? "
                                        "AND set_aside_at_utc IS NULL LIMIT 1", (job_name, old)).first():
                return 0
        with self._tx() as conn:  # not rows --restart set aside: they are run again whatever the rule
            return conn.exec_driver_sql(
                f"UPDATE results SET fingerprint = ? WHERE job_name = ? AND fingerprint = ? AND set_aside_at_utc IS NULL "
                f"AND {uncut_within('results')}", (new, job_name, old, room, CUT_SLACK_TOKENS)).rowcount

    def _archive(self, conn, rows: list[ResultRow], now: str) -> None:
        """Copy the stored rows these will replace into results_history (none, on a first run)."""
        by_job: dict[str, list[str]] = {}
        for row in rows:
            by_job.setdefault(row.job_name, []).append(row.row_id)
        for job, ids in by_job.items():
            for start in range(0, len(ids), DoneFilter.BATCH):
                part = ids[start:start + DoneFilter.BATCH]
                conn.exec_driver_sql(f"{_TO_HISTORY} AND row_id IN ({', '.join('?' * len(part))})",
                                     (now, rows[0].run_id, job, *part))

    def set_aside_results(self, job_name: str, ids: Path, limited: bool) -> tuple[int, int]:
        """`--restart`: mark the job's stored rows whose ids are in the input's `ids` file
        (runner/row_ids.py) to be run again; each stays in `results` (and in `export --job`) until
        its new result moves it to results_history, so a restart stopped midway loses no row, and
        the next run goes on with the rest (a next --restart too: while rows are marked, those
        stored since the first mark are kept; once none is, a --restart marks them all). Not
        `limited` (by --limit), the job's rows that are not in the input move to results_history
        now, replaced by no run: no run would replace them.
        Returns (rows marked, rows moved)."""
        # A connection of its own: SQLite attaches no file inside a transaction.
        con = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        try:
            con.execute("ATTACH DATABASE ? AS scan", (str(ids),))
            con.execute("BEGIN IMMEDIATE")
            # a restart stopped before (rows still marked) goes on: the rows it redid are kept
            (pending,) = con.execute("SELECT min(set_aside_at_utc) FROM results WHERE job_name = ?",
                                     (job_name,)).fetchone()
            marked = con.execute("UPDATE results SET set_aside_at_utc = coalesce(set_aside_at_utc, ?) WHERE job_name = ? "
                                 "AND row_id IN (SELECT id FROM scan.ids) AND created_at_utc < coalesce(?, '~')",
                                 (utc_now(), job_name, pending)).rowcount
            moved = 0
            if not limited:
                gone = " AND row_id NOT IN (SELECT id FROM scan.ids)"
                con.execute(_TO_HISTORY + gone, (utc_now(), None, job_name))
                moved = con.execute("DELETE FROM results WHERE job_name = ?" + gone, (job_name,)).rowcount
            con.execute("COMMIT")
            return marked, moved
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {exc}") from None
        finally:
            con.close()  # uncommitted: rolled back

    def prune_history(self, job_name: str, keep_versions: int, dry_run: bool = False) -> int:
        """Delete from results_history all but the keep_versions most recently replaced versions of
        each of the job's rows (the rows of `results` stay). Returns the rows deleted, or that would be."""
        older = ("SELECT rowid FROM (SELECT rowid, row_number() OVER (PARTITION BY row_id "
                 "ORDER BY replaced_at_utc DESC, rowid DESC) AS n FROM results_history WHERE job_name = ?) WHERE n > ?")
        with self.engine.connect() as conn:
            doomed = list(conn.exec_driver_sql(older, (job_name, keep_versions)).scalars())
        # Versions are only ever added: what is older now stays older. Small transactions, so that a
        # run writing to this file meanwhile never waits past its busy timeout.
        for i in ([] if dry_run else range(0, len(doomed), DoneFilter.BATCH)):
            part = doomed[i:i + DoneFilter.BATCH]
            with self._tx() as conn:
                conn.exec_driver_sql(f"DELETE FROM results_history WHERE rowid IN ({', '.join('?' * len(part))})",
                                     tuple(part))
        return len(doomed)
