"""A job's replaced rows: what a batch replaces, --restart's set-aside and `runner prune`, all in
results_history. A part of Store."""
from __future__ import annotations

from runner.migrations import utc_now
from runner.rows import RESULT_COLUMNS, ResultRow
from runner.store_sqlite import DoneFilter

# A job's stored rows into results_history, with when and by which run (NULL: --restart) they were
# replaced; _archive narrows it to the rows a batch replaces.
_TO_HISTORY = (f"INSERT INTO results_history (id, {', '.join(RESULT_COLUMNS)}, replaced_at_utc, replaced_by_run_id) "
               f"SELECT id, {', '.join(RESULT_COLUMNS)}, ?, ? FROM results WHERE job_name = ?")


class HistoryRecords:
    """Store's methods that move rows into results_history and delete them from it."""

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

    def set_aside_results(self, job_name: str) -> int:
        """`--restart`: move the job's stored rows to results_history (replaced by no run), so that
        the next run redoes every row and the runs that made them still show and export them.
        Returns the rows moved."""
        with self._tx() as conn:
            conn.exec_driver_sql(_TO_HISTORY, (utc_now(), None, job_name))
            return conn.execute(self.results.delete().where(self.results.c.job_name == job_name)).rowcount

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
