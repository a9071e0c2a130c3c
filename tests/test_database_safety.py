"""The results database under failure: atomic creation, concurrent creators, damage, unwritable places."""
from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import runner.migrations as migrations
from runner.cli import cli
from runner.errors import StoreError
from runner.migrations import MIGRATIONS
from runner.store import Store
from tests.test_crash_safety import run_here, runner_cmd


def test_a_migration_that_fails_midway_leaves_no_half_made_schema(tmp_path, monkeypatch):
    def broken(conn):
        conn.exec_driver_sql("CREATE TABLE half (x INTEGER)")
        raise OSError("No space left on device")  # what a full disk looks like halfway

    db = tmp_path / "r.sqlite"
    monkeypatch.setattr(migrations, "MIGRATIONS", [MIGRATIONS[0], broken])
    with pytest.raises(StoreError, match="No space left"):
        Store(db)
    con = sqlite3.connect(db)
    assert con.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall() == []  # all rolled back
    con.close()
    monkeypatch.setattr(migrations, "MIGRATIONS", MIGRATIONS)
    Store(db).close()  # the next run creates it whole
    names = [r[0] for r in sqlite3.connect(db).execute("SELECT name FROM _migrations")]
    assert names == [m.__name__ for m in MIGRATIONS]


def test_two_creators_migrate_in_turn_not_at_once(tmp_path, monkeypatch):
    """The store migrates under BEGIN IMMEDIATE: the second creator waits for the write lock before
    it reads the schema version, so migrations never run side by side (a deferred BEGIN would let
    both read version 0 and race to write). Two threads, two connections, one file."""
    import runner.store as store_module

    inside, most, lock = [0], [0], threading.Lock()
    real = store_module.migrate

    def slow_migrate(conn):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.3)  # long enough for the other thread to arrive
        try:
            real(conn)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(store_module, "migrate", slow_migrate)
    db, errors = tmp_path / "r.sqlite", []

    def create():
        try:
            Store(db).close()
        except Exception as exc:  # recorded: the assertion below names it
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and most[0] == 1


def _open(path: str, barrier) -> None:
    barrier.wait(timeout=60)
    Store(path).close()


def test_processes_creating_one_database_at_once_all_succeed(tmp_path):
    db = str(tmp_path / "shared.sqlite")
    # Forked from a server that has imported the store once (not from pytest, whose threads make
    # fork unsafe): the children are ready at once and a barrier releases them together.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["runner.store", "tests.test_database_safety"])
    barrier = ctx.Barrier(6)
    procs = [ctx.Process(target=_open, args=(db, barrier)) for _ in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 6
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM _migrations").fetchone()[0] == len(MIGRATIONS)


def test_a_file_left_half_made_by_an_older_runner_is_named_not_a_traceback(tmp_path):
    db = tmp_path / "old.sqlite"
    con = sqlite3.connect(db)
    con.execute(migrations._M001_RUNS)  # the old bug: the runner's tables, no migration rows
    con.commit()
    con.close()
    with pytest.raises(StoreError, match=r"old\.sqlite: tables exist but no migration was recorded"):
        Store(db)
    # another program's table named runs is another program's file (it was called half-made)
    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")
    con.commit()
    con.close()
    before = other.read_bytes()
    with pytest.raises(StoreError, match=r"other\.sqlite: not a results database of the runner \(it holds other tables: runs\)"):
        Store(other)
    assert other.read_bytes() == before  # not switched to WAL, nothing added


@pytest.fixture
def fake_env():
    import os

    return dict(os.environ, RUNNER_FAKE_DELAY_S="0.01")


def test_kill_9_while_the_database_is_being_created_then_rerun(make_job, tmp_path, fake_env):
    """The reported repro: SIGKILL as soon as the WAL file appears, then run again, twice."""
    job = make_job(rows=12)
    db = tmp_path / "out" / "results.sqlite"
    wal = Path(f"{db}-wal")
    for _ in range(2):
        for f in db.parent.glob("results.sqlite*"):
            f.unlink()
        proc = subprocess.Popen(runner_cmd("run", "--engine", "fake", "--quiet", job), env=fake_env)
        deadline = time.monotonic() + 60
        while not wal.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL, "the run ended before the kill: nothing was tested"
        done = run_here("run", "--engine", "fake", "--quiet", job)
        assert done.exit_code == 0, done.output
        con = sqlite3.connect(db)
        assert con.execute("SELECT count(*), count(DISTINCT row_id) FROM results").fetchone() == (12, 12)
        con.close()


def damage_page(make_job, tmp_path, root_sql: str, content: bytes) -> tuple:
    """A job run once, then the page named by root_sql (its rootpage) overwritten: (job, db)."""
    job = make_job(rows=30)
    assert CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)]).exit_code == 0
    db = tmp_path / "out" / "results.sqlite"
    con = sqlite3.connect(db)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    root = con.execute(root_sql).fetchone()[0]
    con.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write((content * page_size)[:page_size])
    return job, db


def test_a_damaged_database_is_refused_before_the_run(make_job, tmp_path):
    # the UNIQUE (job_name, row_id) index's root page, zeroed: what a torn write leaves
    job, _ = damage_page(make_job, tmp_path, "SELECT rootpage FROM sqlite_master WHERE type='index' AND "
                                             "tbl_name='results' AND sql IS NULL", b"\0")
    out = CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)])
    assert out.exit_code == 6
    assert out.stderr.startswith("Error: ") and "damaged" in out.stderr and len(out.stderr.splitlines()) == 1


def test_a_damaged_page_met_by_a_command_that_reads_is_one_error_line(make_job, tmp_path):
    """status, export and report run no quick_check: a query that meets a damaged page says so, as
    a run's check does, instead of a traceback."""
    # the results table's root page, garbage
    job, db = damage_page(make_job, tmp_path, "SELECT rootpage FROM sqlite_master WHERE name='results'", bytes(range(256)))
    for args in (["status", str(job)], ["export", "--job", str(job), "--format", "csv"],
                 ["report", "1", "--job", str(job)]):
        out = CliRunner().invoke(cli, args)
        assert out.exit_code == 6, (args, out.output)
        assert out.stderr == f"Error: {db}: the results database is damaged (database disk image is malformed): " \
                             "restore it from a backup or move it away\n", args


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_an_unwritable_database_location_is_one_error_line(make_job, tmp_path, where):
    (tmp_path / "a_file").write_text("not a folder")
    database = str(tmp_path / "a_file" / "results.sqlite") if where == "under_a_file" else "/proc/runner-test/r.sqlite"
    job = make_job(rows=3, job={"output": {"database": database}})
    here = CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)])
    outcomes = [(here.exit_code, here.stderr)]
    if where == "under_a_file":  # once as a process too: what the user's terminal shows, nothing else
        proc = subprocess.run(runner_cmd("run", "--engine", "fake", "--quiet", job), capture_output=True, text=True,
                              timeout=120)
        outcomes.append((proc.returncode, proc.stderr))
    for code, err in outcomes:
        assert code == 6, err
        assert err.startswith("Error: ") and len(err.splitlines()) == 1
        assert "results.sqlite" in err or "r.sqlite" in err


@pytest.fixture
def listener():
    """A TCP server on loopback that counts connections: nothing may connect to it."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    seen, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                seen.append(conn)
                conn.close()
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1], seen
    stop.set()
    srv.close()


def test_a_schema_ref_to_a_url_is_refused_at_validate_without_a_connection(make_job, tmp_path, listener):
    import json

    from tests.conftest import SCHEMA

    port, seen = listener
    remote = SCHEMA | {"properties": SCHEMA["properties"] | {"source": {"$ref": f"http://127.0.0.1:{port}/s.json"}}}
    job = make_job(rows=3, schema=remote)
    out = CliRunner().invoke(cli, ["validate", str(job)])
    assert out.exit_code == 2 and out.output.startswith("Error: ") and len(out.output.splitlines()) == 1
    assert "out.json: #/properties/source/$ref" in out.output and "never fetches" in out.output
    out = CliRunner().invoke(cli, ["run", "--engine", "fake", str(job)])
    assert out.exit_code == 2 and not (tmp_path / "out" / "results.sqlite").exists()
    time.sleep(0.3)
    assert seen == []
    # A reference inside the file keeps working.
    local = SCHEMA | {"$defs": {"s": {"type": "string", "maxLength": 20}},
                      "properties": SCHEMA["properties"] | {"summary": {"$ref": "#/$defs/s"}}}
    (tmp_path / "schemas" / "out.json").write_text(json.dumps(local))
    assert CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)]).exit_code == 0


def test_the_output_checker_never_fetches_a_reference(listener):
    from runner.engines.base import Completion
    from runner.outputs import OutputChecker

    port, seen = listener
    checker = OutputChecker({"type": "object", "properties": {"a": {"$ref": f"http://127.0.0.1:{port}/a.json"}}})
    with pytest.raises(Exception):
        checker.check(Completion("r", text='{"a": 1}', finish_reason="stop"), 10)
    time.sleep(0.3)
    assert seen == []


def test_another_programs_sqlite_file_is_refused_and_left_as_it_was(make_job, tmp_path):
    """Pointed at a SQLite file of another program, no command writes the runner's schema into it
    nor switches it to WAL: run, status, stats and prune --dry-run refuse it, naming the file."""
    job = make_job(rows=3)
    db = tmp_path / "out" / "results.sqlite"
    db.parent.mkdir()
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE invoices (x INTEGER)")
    con.commit()
    con.close()
    before = db.read_bytes()
    out = CliRunner().invoke(cli, ["validate", str(job)])  # found before the night
    assert out.exit_code != 0 and "another program's SQLite database (tables: invoices)" in out.output
    for args in (["run", "--engine", "fake", "--quiet", str(job)], ["status", str(job)], ["stats", "--db", str(db)],
                 ["prune", str(job), "--keep-versions", "1", "--dry-run"]):
        out = CliRunner().invoke(cli, args)
        assert out.exit_code == 6, (args, out.output)
        assert out.stderr == f"Error: {db}: not a results database of the runner (it holds other tables: invoices): " \
                             "name another file\n"
    assert db.read_bytes() == before and not db.with_name(db.name + "-wal").exists()


def test_a_database_missing_one_of_its_tables_is_one_error_line_in_every_command(make_job, tmp_path):
    """A table dropped by hand (its migration still recorded) was a KeyError traceback in stats,
    status, export, report and prune."""
    job = make_job(rows=3)
    assert CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)]).exit_code == 0
    db = tmp_path / "out" / "results.sqlite"
    with sqlite3.connect(db) as con:
        con.execute("DROP TABLE run_stats")
    for args in (["stats", "--db", str(db)], ["status", str(job)], ["export", "--job", str(job), "--format", "csv"],
                 ["report", "1", "--job", str(job)], ["prune", str(job), "--keep-versions", "1", "--dry-run"],
                 ["run", "--engine", "fake", "--quiet", str(job)]):
        out = CliRunner().invoke(cli, args)
        assert out.exit_code == 6, (args, out.output)
        assert out.stderr == f"Error: {db}: the results database is damaged (its table run_stats is missing): " \
                             "restore it from a backup or move it away\n", args


def test_reading_commands_leave_an_empty_sqlite_database_as_it_was(make_job, tmp_path):
    """A SQLite file with no tables (made by a tool, or `sqlite3 f.sqlite 'vacuum'`) got the runner's
    11 tables from stats, status or export, commands that only read: it is "no results yet"."""
    job = make_job(rows=3)
    db = tmp_path / "out" / "results.sqlite"
    db.parent.mkdir()
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE t (x)")
        con.execute("DROP TABLE t")
    before = db.read_bytes()
    for args in (["stats", "--db", str(db)], ["export", "--job", str(job), "--format", "csv"],
                 ["export", "--db", str(db), "-o", str(tmp_path / "x.jsonl")]):
        out = CliRunner().invoke(cli, args)
        assert out.exit_code != 0 and out.stderr.startswith("Error: ") and len(out.stderr.splitlines()) == 1, (args, out.output)
        assert db.read_bytes() == before, args
    out = CliRunner().invoke(cli, ["status", str(job)])  # as for an empty file: nothing stored, all to run
    assert out.exit_code == 0 and "no rows stored yet" in out.output and "all 3 input rows" in out.output, out.output
    assert db.read_bytes() == before
    assert "an empty SQLite database, no results yet" in CliRunner().invoke(cli, ["stats", "--db", str(db)]).stderr
    assert CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)]).exit_code == 0  # a run makes it


def _can_mount_read_only() -> bool:
    """User and mount namespaces (unshare -rm): a read-only bind mount without privileges."""
    import shutil

    return bool(shutil.which("unshare")) and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


def _on_a_read_only_mount(folder: Path, *args):
    """`runner ARGS` with `folder` mounted read-only over itself, as a backup share or a container's
    read-only volume holds a results database."""
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, str(folder), *runner_cmd(*args)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not _can_mount_read_only(), reason="needs unshare -rm (user and mount namespaces)")
def test_stats_status_and_export_read_a_database_on_a_read_only_mount(make_job, tmp_path):
    job = make_job(rows=5)
    assert run_here("run", "--engine", "fake", "--quiet", job).exit_code == 0
    out = tmp_path / "out"
    commands = [("stats", "--job", job), ("status", job), ("export", "--job", job, "--format", "jsonl"),
                ("export", "1", "--db", out / "results.sqlite", "--format", "csv"),
                ("report", "1", "--job", job, "-o", tmp_path / "report.html")]
    for args in commands:
        ro = _on_a_read_only_mount(out, *args)
        assert ro.returncode == 0 and "Error" not in ro.stderr, (args, ro.stderr)
        assert ro.stdout == run_here(*args).stdout, args  # what the writable copy shows
    # A copy taken during a run: changes in its write-ahead log are read with the -shm file beside
    # it, and named, not read past, without it.
    con = sqlite3.connect(out / "results.sqlite")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("UPDATE runs SET error = 'in the log'")
    con.commit()
    try:
        with_shm = _on_a_read_only_mount(out, "stats", "--job", job)
        (out / "results.sqlite-shm").unlink()
        ro = _on_a_read_only_mount(out, "stats", "--job", job)
    finally:
        con.close()
    assert with_shm.returncode == 0 and "in the log" in with_shm.stdout, with_shm
    assert ro.returncode == 6 and ro.stdout == "", ro
    assert ro.stderr == (f"Error: {out / 'results.sqlite'}: cannot be read as it is: its write-ahead log "
                         "(results.sqlite-wal) holds changes that SQLite reads through a results.sqlite-shm file, "
                         "which is not there; copy the database with its -wal file to a folder you can write, or "
                         "read it as the user who runs the job\n")


def test_validate_refuses_a_damaged_database_as_run_does(make_job, tmp_path):
    """`runner validate JOB && runner run JOB` stops at validate wherever run would stop first."""
    job = make_job(rows=300)
    assert run_here("run", "--engine", "fake", "--quiet", job).exit_code == 0
    db = tmp_path / "out" / "results.sqlite"
    with open(db, "r+b") as f:
        f.truncate(db.stat().st_size // 2)
    for args in (("validate", job), ("run", "--engine", "fake", "--quiet", job)):
        r = run_here(*args)
        assert r.exit_code == 6 and r.output.startswith(f"Error: {db}: the results database is damaged ("), (args, r.output)


def test_a_newer_runners_database_is_refused_by_every_command_and_left_as_it_was(make_job, tmp_path):
    """A migration this runner does not know: a newer runner's file, which this one could misread
    or write rows into that the newer one misreads."""
    job = make_job(rows=2)
    assert run_here("run", "--engine", "fake", "--quiet", job).exit_code == 0
    db = tmp_path / "out" / "results.sqlite"
    con = sqlite3.connect(db)
    con.execute("INSERT INTO _migrations VALUES ('m999_from_the_future', '2030-01-01')")
    con.commit()
    con.close()
    before = db.read_bytes()
    for args in (("run", "--engine", "fake", "--restart", job), ("stats", "--db", db), ("validate", job)):
        r = run_here(*args)
        assert r.exit_code == 6, (args, r.output)
        assert f"{db}: made by a newer runner (its migration m999_from_the_future is unknown to runner " in r.output
    assert db.read_bytes() == before
    assert sqlite3.connect(db).execute("SELECT count(*) FROM results").fetchone()[0] == 2


@pytest.mark.skipif(not _can_mount_read_only(), reason="needs unshare -rm (user and mount namespaces)")
def test_an_older_runners_database_on_a_read_only_mount_names_the_migration_it_lacks(make_job, tmp_path):
    job = make_job(rows=2)
    assert run_here("run", "--engine", "fake", "--quiet", job).exit_code == 0
    db = tmp_path / "out" / "results.sqlite"
    con = sqlite3.connect(db)
    con.execute("DELETE FROM _migrations WHERE name = ?", (MIGRATIONS[-1].__name__,))
    con.commit()
    con.close()
    ro = _on_a_read_only_mount(db.parent, "stats", "--db", db)
    assert ro.returncode == 6 and ro.stderr == (
        f"Error: {db}: made by an older runner, it needs its migration {MIGRATIONS[-1].__name__} to be read, and this "
        "user cannot write it here: copy it to a folder you can write, or run any runner command on it as the user "
        "who runs the job\n"), ro.stderr


def test_reading_another_users_database_leaves_nothing_beside_it(make_job, tmp_path):
    """A database in a shared folder that this user may not write: read without the -shm and -wal
    files SQLite would make, which, owned by this user, would stop the owner's next run."""
    import os
    import shutil
    import tempfile

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to read as another user")
    job = make_job(rows=3)
    assert run_here("run", "--engine", "fake", "--quiet", job).exit_code == 0
    shared = Path(tempfile.mkdtemp())
    try:
        shared.chmod(0o777)
        db = shared / "results.sqlite"
        src, dst = sqlite3.connect(tmp_path / "out" / "results.sqlite"), sqlite3.connect(db)
        src.backup(dst)
        src.close(), dst.close()
        db.chmod(0o644)
        other = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                                *runner_cmd("stats", "--db", db)], capture_output=True, text=True, timeout=120)
        assert other.returncode == 0, other.stderr
        assert sorted(os.listdir(shared)) == ["results.sqlite"]
        assert other.stdout == run_here("stats", "--db", db).stdout
    finally:
        shutil.rmtree(shared)


def _written_by_a_run_meanwhile(db: Path) -> None:
    """What a run that starts during a read does to the file: commits, and folds its log in."""
    con = sqlite3.connect(db)
    con.execute("UPDATE runs SET error = 'a later run'")
    con.commit()
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()


def test_a_read_without_locks_that_a_run_wrote_under_says_so_not_damaged(make_job, tmp_path):
    """A reading Store that cannot take SQLite's locks (another user's file, a read-only folder:
    opened immutable) and finds the file changed since it opened reports ChangedWhileRead (exit 75,
    try again), also where the read failed as if the file were damaged; unchanged, nothing."""
    from runner.errors import ChangedWhileRead
    from runner.store_sqlite import _damaged, _signature

    assert run_here("run", "--engine", "fake", "--quiet", make_job(rows=3)).exit_code == 0
    db = tmp_path / "out" / "results.sqlite"
    store = Store(db, read_only=True)  # as for_reading opens it where this user cannot write
    store.check_unchanged()  # nothing wrote: no error
    assert store.latest_runs("t")
    seen = _signature(db)  # as the store found it at its opening
    _written_by_a_run_meanwhile(db)
    with pytest.raises(ChangedWhileRead, match="wrote to the database while this command read it") as exc:
        store.check_unchanged()
    assert exc.value.exit_code == 75
    malformed = sqlite3.DatabaseError("database disk image is malformed")
    with pytest.raises(ChangedWhileRead):
        _damaged(db, malformed, seen)
    with pytest.raises(StoreError, match="damaged"):  # the file as it is now: damage, as before
        _damaged(db, malformed, _signature(db))
    store.close()
    writable = Store.for_reading(db)  # this user may write: SQLite's locks keep the read whole
    _written_by_a_run_meanwhile(db)
    writable.check_unchanged()
    writable.close()


def test_an_export_whose_read_a_run_wrote_under_leaves_the_old_file(tmp_path):
    from runner.errors import ChangedWhileRead
    from runner.whole_file import write_whole

    out = tmp_path / "x.csv"
    out.write_text("yesterday\n")

    def changed():
        raise ChangedWhileRead("changed")

    with pytest.raises(ChangedWhileRead):
        write_whole(out, lambda part: part.write_text("mixed\n"), check=changed)
    assert out.read_text() == "yesterday\n" and sorted(p.name for p in tmp_path.iterdir()) == ["x.csv"]


def test_a_part_a_killed_writer_left_goes_with_the_next_write_and_a_live_writers_stays(tmp_path):
    """SIGKILL runs no cleanup: an export killed midway left its hidden part beside the file for good."""
    import subprocess
    import sys

    from runner.whole_file import write_whole

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live = int(gone.stdout), os.getppid()  # a process that has ended, and one that runs
    old = time.time() - 3600
    for name, text in ((f".x.csv.{dead}.part", "half an export\n"), (f".x.csv.{live}.part", "being written\n"),
                       (".y.csv.1.part", "another file's\n"), (".x.csv.99999999999999999999.part", "not a pid\n"),
                       (".x.csv.\u00b2.part", "not a pid\n")):
        (tmp_path / name).write_text(text)
        os.utime(tmp_path / name, (old, old))
    write_whole(tmp_path / "x.csv", lambda part: part.write_text("today\n"))
    left = {p.name for p in tmp_path.iterdir()}
    assert f".x.csv.{dead}.part" not in left and {f".x.csv.{live}.part", ".y.csv.1.part", "x.csv"} <= left
    assert len(left) == 5 and (tmp_path / "x.csv").read_text() == "today\n"
    # a dead pid's part that changed lately may be a writer's on another host sharing the folder: kept
    (tmp_path / f".x.csv.{dead}.part").write_text("another host's\n")
    write_whole(tmp_path / "x.csv", lambda part: part.write_text("again\n"))
    assert (tmp_path / f".x.csv.{dead}.part").exists()


@pytest.mark.parametrize("args", [["stats"], ["stats", "--json"], ["status"], ["report", "1", "-o", "r.html"],
                                  ["export", "-o", "x.csv"], ["export", "--format", "jsonl"],
                                  ["prune", "--keep-versions", "1", "--dry-run"]])
def test_every_reading_command_checks_its_read_without_locks_was_whole(make_job, tmp_path, monkeypatch, args):
    """Each reading command, on a database it reads without SQLite's locks, says that a run wrote
    under it (exit 75) rather than printing or writing what it read; a file it would write is not."""
    import itertools

    import runner.store_sqlite as store_sqlite

    job = make_job(rows=3)
    assert run_here("run", "--engine", "fake", "--quiet", job).exit_code == 0
    monkeypatch.setattr(Store, "for_reading", classmethod(lambda cls, p: cls(p, read_only=True)))
    ticks = itertools.count()
    monkeypatch.setattr(store_sqlite, "_signature", lambda path: (next(ticks),))  # a write between any two looks
    monkeypatch.chdir(tmp_path)
    cmd = args[:1] + (["--job", str(job)] if args[0] in ("stats", "report", "export") else [str(job)]) + args[1:]
    out = CliRunner().invoke(cli, cmd)
    assert out.exit_code == 75, out.output
    assert out.stderr.startswith("Error: ") and "wrote to the database while this command read it" in out.stderr
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "x.csv").exists()
    if args[0] == "stats":
        assert out.stdout == ""  # nothing printed of a read that may be mixed
