"""The input's rows as the results table holds them: counts joined on disk with the row ids of a
scan (runner/row_ids.py), so that no set of a million ids sits in memory. A part of Store."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Sequence

from runner.errors import StoreError
from runner.store_history import CUT_SLACK_TOKENS, uncut_within
from runner.store_sqlite import BUSY_TIMEOUT_MS, InputCounts, read_uri


class InputRecords:
    """Store's methods that join the results table with an input's row ids."""

    def input_counts(self, job_name: str, ids_file: Path, fingerprint: str,
                     adoptable: Sequence[tuple[str, int]] = ()) -> InputCounts:
        """How many of the input's rows are stored: in all, by this version of the job (or before
        fingerprints), and ok (by any version). One pass, joined on disk with the input's row ids
        (runner/row_ids.py): no set of a million ids in memory. adoptable: (fingerprint, most room)
        of the versions whose rows a run would keep (see adopt_uncut_rows), counted as this version's."""
        also = "".join(f" OR (r.fingerprint = ? AND {uncut_within('r')})" for _ in adoptable)
        # a row --restart set aside is stored, but neither this version's nor ok: the next run redoes it
        q = (f"SELECT count(*), coalesce(sum((r.fingerprint = ? OR r.fingerprint IS NULL{also}) "
             "AND r.set_aside_at_utc IS NULL), 0), coalesce(sum(r.status = 'ok' AND r.set_aside_at_utc IS NULL), 0), "
             "coalesce(sum(r.set_aside_at_utc IS NOT NULL), 0) "
             "FROM scan.ids i JOIN results r ON r.job_name = ? AND r.row_id = i.id")
        params = (fingerprint, *(p for fp, room in adoptable for p in (fp, room, CUT_SLACK_TOKENS)))
        return InputCounts(*self._with_input_ids(ids_file, q, (*params, job_name))[0])

    def input_status_counts(self, job_name: str, ids_file: Path) -> dict[str, int]:
        """The input's stored rows by status: what output.max_failed_fraction is judged on (rows
        dropped from the input since an earlier night no longer count)."""
        q = ("SELECT r.status, count(*) FROM scan.ids i JOIN results r ON r.job_name = ? AND r.row_id = i.id "
             "GROUP BY r.status")
        return dict(self._with_input_ids(ids_file, q, (job_name,)))

    def same_rows_elsewhere(self, job_name: str, ids_file: Path, fingerprint: str) -> list[tuple[str, int]]:
        """(job name, input rows it stores) of the other jobs in this database that store rows of
        this input by ids, made by a job exactly like this one (the same fingerprint), most first.
        Only for a job with no row stored at all (a job renamed); the fingerprints table names the
        candidates, and each is counted through the (job_name, row_id) index."""
        with self.engine.connect() as conn:
            if conn.exec_driver_sql("SELECT 1 FROM results WHERE job_name = ? LIMIT 1", (job_name,)).first():
                return []
            names = [n for (n,) in conn.exec_driver_sql(
                "SELECT job_name FROM fingerprints WHERE fingerprint = ? AND job_name != ?", (fingerprint, job_name))]
        q = ("SELECT count(*) FROM scan.ids i JOIN results r ON r.job_name = ? AND r.row_id = i.id "
             "AND r.fingerprint = ?")
        found = [(n, self._with_input_ids(ids_file, q, (n, fingerprint))[0][0]) for n in names]
        return sorted([f for f in found if f[1]], key=lambda f: (-f[1], f[0]))

    def _with_input_ids(self, ids_file: Path, query: str, params: tuple) -> list[tuple]:
        # A connection of its own: the ATTACH must not outlive the query in SQLAlchemy's pool.
        con = sqlite3.connect(read_uri(self.path) if self.read_only else str(self.path), uri=self.read_only,
                              timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            con.execute("ATTACH DATABASE ? AS scan", (str(ids_file),))
            return con.execute(query, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {exc}") from None
        finally:
            con.close()
