"""The SQLite connection under Store: pragmas (WAL, synchronous=NORMAL, a busy timeout, foreign
keys), explicit BEGIN, transactions whose errors name the file, and the done-row filter that the
input-reading thread asks on a connection of its own; and, without opening it, whether the
database a job names could be made and written where it is."""
from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional
from urllib.parse import quote

from sqlalchemy import create_engine, event
from sqlalchemy.exc import SQLAlchemyError

from runner.errors import ChangedWhileRead, StoreError

BUSY_TIMEOUT_MS = 30_000
IMMUTABLE = "&immutable=1"  # read_uri's read without SQLite's locks


def sqlite_engine(path: Path, read_only: bool = False) -> tuple[Any, Optional[tuple]]:
    """A SQLAlchemy engine on the file, every connection set up by _pragmas, every transaction
    begun by _begin (BEGIN, or what the connection's `sqlite_begin` option says). `read_only`: for
    commands that only read, through read_uri (a read-only mount, a backup share). With it, the
    file's signature where that read takes no locks (for check_unchanged; else None)."""
    seen = None
    if read_only:
        uri = read_uri(path)
        seen = _signature(path) if uri.endswith(IMMUTABLE) else None  # decided once, with the URI
        connect = lambda: sqlite3.connect(uri, uri=True, check_same_thread=False,  # noqa: E731
                                          timeout=BUSY_TIMEOUT_MS / 1000)
    else:
        connect = lambda: sqlite3.connect(str(path), check_same_thread=False,  # noqa: E731
                                          timeout=BUSY_TIMEOUT_MS / 1000)
    # The file is opened by name, not through a URL: `#`, `?` or `%` in a path (out/team#2/) cut it
    # short there, and the run wrote another file than the one its lock and log are beside. The URL
    # only tells SQLAlchemy that this is a file database (its pool for one).
    engine = create_engine("sqlite:///database-file", creator=connect)
    event.listen(engine, "connect", _read_pragmas if read_only else _pragmas)
    event.listen(engine, "begin", _begin)
    event.listen(engine, "handle_error", lambda ctx: _damaged(path, ctx.original_exception, seen))
    return engine, seen


def _signature(path: Path) -> tuple:
    """What a run's write to the file changes (a checkpoint folds its write-ahead log in)."""
    try:
        st = path.stat()  # the inode and ctime too: coarse or cached times on shares
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
    except OSError:
        return ()


def check_unchanged(path: Path, seen: Optional[tuple]) -> None:
    """ChangedWhileRead where a read without locks (`seen`: the file as it began) may have met a
    run's writes: what it read may mix the file before and after them, or fail as if damaged."""
    if seen is not None and _signature(path) != seen:
        raise ChangedWhileRead(f"{path}: a run of the job wrote to the database while this command read it "
                               "(this user cannot take SQLite's locks on it here): run the command again")


def _damaged(path: Path, exc: BaseException, seen: Optional[tuple] = None) -> None:
    """A page that cannot be read, met by any query (status, export, report read what a run's
    quick_check would have refused): the runner's StoreError, not SQLAlchemy's traceback; or, read
    without locks while a run wrote, ChangedWhileRead (not damage)."""
    # sqlite3's own class for SQLITE_CORRUPT and SQLITE_NOTADB; its subclasses (locked, full disk,
    # constraints) are not damage and keep their own handling
    if isinstance(exc, sqlite3.Error):  # a torn read fails in many ways ("no such table" too)
        check_unchanged(path, seen)
    if type(exc) is sqlite3.DatabaseError:
        if "file is not a database" in str(exc):  # no SQLite header: a job file given as --db, or a torn one
            raise StoreError(f"{path}: not a SQLite database ({exc}): name the job's results database, or "
                             "restore this one from a backup")
        raise StoreError(f"{path}: the results database is damaged ({exc}): restore it from a backup or move it away")


def refuse_foreign(path: Path) -> None:
    """StoreError for a SQLite file of another program (tables, neither `_migrations` nor `runs`),
    read without writing to it: it is refused, not given the runner's schema and WAL mode."""
    foreign = _foreign_tables(path)
    if foreign:
        raise StoreError(f"{path}: not a results database of the runner (it holds other tables: "
                         f"{', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}): name another file")


def _foreign_tables(path: Path) -> list[str]:
    """[] for a runner's database, no file, an empty one, or one SQLite cannot read (opening it
    names that). A table `runs` of another program's (without the runner's columns) is foreign too:
    it was taken for a runner's file half-made by an interrupted first run."""
    names = table_names(path)
    if not names or "_migrations" in names:
        return []
    if "runs" in names:
        columns = table_columns(path, "runs")
        if columns is None or _RUNS_COLUMNS <= columns:  # unreadable: opening it names why
            return []
    return sorted(names)


_RUNS_COLUMNS = {"job_name", "job_path", "config_json", "runner_version"}  # the runner's table runs has these


def table_columns(path: Path, table: str) -> Optional[set[str]]:
    """The columns of a table of the SQLite file at path, read without writing to it (None: unreadable)."""
    rows = _read_without_writing(path, f"PRAGMA table_info({table})")
    return None if rows is None else {r[1] for r in rows}


def _read_without_writing(path: Path, sql: str) -> Optional[list[tuple]]:
    """The rows of one query on the SQLite file at path, through read_uri (None: SQLite cannot read it)."""
    try:
        con = sqlite3.connect(read_uri(path), uri=True)
        try:
            return con.execute(sql).fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return None


def read_uri(path: Path) -> str:
    """The URI that reads the file and makes nothing beside it. A database in WAL mode is read
    through its -shm file: where one is there (a run is going on, or a copy kept it), through that;
    where none is, the file alone holds every change, and is opened immutable: SQLite would
    otherwise make the -shm and -wal files, which it cannot in a read-only folder, and which,
    made by another user, stop the owner's next run."""
    ro = f"file:{quote(str(path))}?mode=ro"
    if path.with_name(path.name + "-shm").exists():
        return ro
    wal = path.with_name(path.name + "-wal")
    if wal.is_file() and wal.stat().st_size:
        if os.access(path.parent, os.W_OK) and os.access(path, os.W_OK):
            return ro  # this user may make the -shm, as its runs do
        raise StoreError(f"{path}: cannot be read as it is: its write-ahead log ({wal.name}) holds changes that "
                         f"SQLite reads through a {path.name}-shm file, which is not there; copy the database with "
                         "its -wal file to a folder you can write, or read it as the user who runs the job")
    return ro + IMMUTABLE


def table_names(path: Path) -> Optional[set[str]]:
    """The tables of the SQLite file at path, read without writing to it; None where there is no
    file, an empty one, or one SQLite cannot read."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    rows = _read_without_writing(path, "SELECT name FROM sqlite_master WHERE type = 'table'")
    return None if rows is None else {r[0] for r in rows}


class InputCounts(NamedTuple):
    """The input's rows stored in the results table (Store.input_counts)."""
    stored: int  # by any version of the job
    current: int  # by this version (or before fingerprints): a run keeps them
    ok: int  # status ok, by any version: a run with --retry-failed keeps them
    set_aside: int = 0  # marked by a --restart to be run again (counted in neither current nor ok)

    def kept(self, retry_failed: bool) -> int:
        return self.ok if retry_failed else self.current


class DoneFilter:
    """Which of a batch of row ids a run skips (see Store.done_row_ids), asked of the database a
    batch at a time on a read-only connection of its own: it runs in the input-reading thread, and
    a million done ids never sit in memory."""

    BATCH = 900  # under SQLite's smallest limit on bound parameters

    def __init__(self, path: Path, job_name: str, fingerprint: str, ok_only: bool):
        self.path, self.job_name, self.fingerprint = path, job_name, fingerprint
        # a row --restart set aside is stored (and exported) until its new result replaces it: not done
        self.cond = ("status = 'ok'" if ok_only else "(fingerprint = ? OR fingerprint IS NULL)") + \
            " AND set_aside_at_utc IS NULL"
        self.ok_only = ok_only
        self._con: Optional[sqlite3.Connection] = None
        self._closed = False

    def __call__(self, ids: list[str]) -> set[str]:
        if self._closed:  # a reading thread that outlived its run must not open the database again
            raise RuntimeError("the done-row filter is closed")
        if self._con is None:
            self._con = sqlite3.connect(f"file:{quote(str(self.path))}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000,
                                        check_same_thread=False)
        out: set[str] = set()
        for start in range(0, len(ids), self.BATCH):
            part = ids[start:start + self.BATCH]
            args = [self.job_name, *part] + ([] if self.ok_only else [self.fingerprint])
            out.update(r[0] for r in self._con.execute(
                f"SELECT row_id FROM results WHERE job_name = ? AND row_id IN ({','.join('?' * len(part))}) "
                f"AND {self.cond}", args))
        return out

    def close(self) -> None:
        self._closed = True
        if self._con is not None:
            self._con.close()
            self._con = None


class Transaction:
    """engine.begin(), with database errors turned into StoreError naming the file."""

    def __init__(self, engine, path):
        self.engine, self.path = engine, path

    def __enter__(self):
        try:
            self.ctx = self.engine.begin()
            return self.ctx.__enter__()
        except SQLAlchemyError as exc:
            raise StoreError(f"{self.path}: {short_error(exc)}") from None

    def __exit__(self, et, ev, tb):
        try:
            suppressed = self.ctx.__exit__(et, ev, tb)
        except SQLAlchemyError as exc:
            raise StoreError(f"{self.path}: {short_error(exc)}") from None
        if isinstance(ev, SQLAlchemyError):
            raise StoreError(f"{self.path}: {short_error(ev)}") from None
        return suppressed


def _pragmas(dbapi_conn, _record) -> None:
    # pysqlite commits on its own before DDL; with its transaction handling off, _begin emits BEGIN
    # and SQLAlchemy's commit is the only one (SQLAlchemy's documented recipe for SQLite).
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    _wal(cur)
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _read_pragmas(dbapi_conn, _record) -> None:
    """_pragmas for a read-only connection: nothing that writes (the journal mode is the file's)."""
    dbapi_conn.isolation_level = None
    dbapi_conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")


def _wal(cur) -> None:
    """PRAGMA journal_mode=WAL, waited for: switching a file that another process is creating can
    be refused at once ("database is locked"), busy timeout or not (1 in 15 runs of six processes
    creating one database at once failed so)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _begin(conn) -> None:
    conn.exec_driver_sql(conn.get_execution_options().get("sqlite_begin", "BEGIN"))


def short_error(exc: Exception) -> str:
    return str(getattr(exc, "orig", None) or exc).splitlines()[0]


def named(path: Path, exc: StoreError) -> StoreError:
    """The error with the file's name in front, unless its message begins with it already."""
    text = str(exc)
    return StoreError(text if text.startswith(f"{path}:") else f"{path}: {text}")


def refuse_damaged(path: Path, problems: list[str]) -> None:
    """StoreError for what PRAGMA quick_check found (["ok"]: nothing)."""
    if problems != ["ok"]:
        raise StoreError(f"{path}: the results database is damaged ({problems[0]}; {len(problems)} "
                         f"problem(s) found by PRAGMA quick_check): restore it from a backup or move it away")


def check_database(path: Path) -> None:
    """`validate`'s look at an existing database, reading only, after refuse_unwritable (which
    refuses another program's file): a newer runner's file, or a damaged one, stops here as it
    would stop `runner run` (an older runner's is upgraded by the run)."""
    from runner.migrations import pending_migrations

    if not (path.is_file() and path.stat().st_size):
        return
    try:
        pending_migrations(path)
        con = sqlite3.connect(read_uri(path), uri=True)
        try:
            problems = [r[0] for r in con.execute("PRAGMA quick_check")]
        finally:
            con.close()
    except sqlite3.OperationalError as exc:  # locked, or unreadable: not damage
        raise StoreError(f"{path}: cannot open the results database: {short_error(exc)}") from None
    except sqlite3.DatabaseError as exc:
        problems = [str(exc)]
    except StoreError as exc:
        raise named(path, exc) from None
    refuse_damaged(path, problems)
