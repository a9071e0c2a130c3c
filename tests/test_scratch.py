"""The private folder for the files vLLM leaves behind (runner/scratch.py)."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from runner import scratch


@pytest.fixture
def fresh(monkeypatch):
    """scratch as in a new process whose temporary folder is a new one, short like /tmp's."""
    tmp = Path(tempfile.mkdtemp(dir="/tmp"))
    monkeypatch.setattr(scratch, "_made", None)
    monkeypatch.setattr(scratch, "_lock_fd", None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    yield tmp
    scratch.remove_scratch()
    shutil.rmtree(tmp, ignore_errors=True)


def _holding_lock(folder: Path) -> subprocess.Popen:
    """Another process (as in another container: its PID means nothing here) holding folder's lock."""
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder / ".lock")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _left_behind(parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir()
    (folder / ".lock").write_text("")
    (folder / "socket").write_text("")
    return folder


def test_one_folder_per_process_named_by_its_pid_and_removed(fresh):
    folder = scratch.scratch_dir()
    assert folder.parent == fresh and folder.name.startswith(f"runner-tmp-{os.getpid()}-")
    assert scratch.scratch_dir() == folder
    assert [p.name for p in fresh.iterdir()] == [folder.name]  # nothing half-made left beside it
    (folder / "socket").write_text("")
    scratch.remove_scratch()
    assert not folder.exists()


def test_removed_it_is_made_again_at_the_same_path(fresh):
    # vLLM caches the sockets' folder for the rest of the process: a later engine must find it
    folder = scratch.scratch_dir()
    scratch.remove_scratch()
    assert scratch.scratch_dir() == folder and folder.is_dir()
    assert scratch.sweep_stale(fresh) == [] and folder.is_dir()  # locked again


def test_only_folders_no_process_holds_are_swept(fresh):
    stale = _left_behind(fresh, "runner-tmp-4242-abc")
    in_use = _left_behind(fresh, "runner-tmp-4243-def")  # its PID may be any here: the lock decides
    holder = _holding_lock(in_use)
    unlocked = fresh / "runner-tmp-4244-ghi"  # no lock file: not made by the runner as it is now
    unlocked.mkdir()
    target = _left_behind(fresh, "elsewhere")
    (fresh / "runner-tmp-4245-link").symlink_to(target)
    try:
        folder = scratch.scratch_dir()
    finally:
        holder.kill()
        holder.wait()
    assert not stale.exists()
    assert in_use.exists() and unlocked.exists() and (target / "socket").exists()
    assert folder.exists() and (folder / ".lock").exists()
    assert scratch.sweep_stale(fresh) == [in_use]  # its holder is gone now


def test_a_half_made_folder_is_swept_once_its_maker_is_gone(fresh):
    # made under a hidden name, then locked, then renamed: a process killed in between leaves it
    locked_dead = _left_behind(fresh, ".runner-tmp-a1")  # killed after locking: its lock is free
    locked_live = _left_behind(fresh, ".runner-tmp-b2")
    young = fresh / ".runner-tmp-c3"  # no lock yet: maybe being made right now
    young.mkdir()
    old = fresh / ".runner-tmp-d4"  # no lock, and older than any making takes
    old.mkdir()
    past = time.time() - scratch.HALF_MADE_S - 5
    os.utime(old, (past, past))
    holder = _holding_lock(locked_live)
    try:
        removed = scratch.sweep_stale(fresh)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(removed) == sorted([locked_dead, old])
    assert locked_live.exists() and young.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's folder needs root")
def test_another_users_folder_is_never_swept(fresh):
    theirs = _left_behind(fresh, "runner-tmp-4246-jkl")
    os.chown(theirs, 4321, 4321)
    assert scratch.sweep_stale(fresh) == [] and theirs.exists()


def test_a_forked_child_leaves_its_parents_folder(fresh):
    folder = scratch.scratch_dir()
    pid = os.fork()
    if pid == 0:  # the child: what an engine-core process forked by vLLM would do at its exit
        scratch.remove_scratch()
        os._exit(0)
    os.waitpid(pid, 0)
    assert folder.exists()


def test_vllm_files_go_to_the_folder_only_while_an_engine_is_built(fresh, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(fresh))
    with scratch.vllm_files_here() as folder:
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(folder)
        assert tempfile.gettempdir() == str(folder)  # the file store, in this process or a forked one
        assert os.environ["TMPDIR"] == str(folder)  # ... or a spawned one
    assert "VLLM_RPC_BASE_PATH" not in os.environ
    assert tempfile.gettempdir() == str(fresh) and os.environ["TMPDIR"] == str(fresh)


def test_a_users_own_socket_folder_is_kept(fresh, monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/srv/sockets")
    with scratch.vllm_files_here():
        assert os.environ["VLLM_RPC_BASE_PATH"] == "/srv/sockets"
    assert os.environ["VLLM_RPC_BASE_PATH"] == "/srv/sockets"


def test_under_a_long_tmpdir_the_sockets_stay_where_vllm_puts_them(fresh, monkeypatch):
    # ZMQ refuses an ipc path over 107 bytes; vLLM names each socket by a uuid4
    long_dir = fresh / ("d" * 60)
    long_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir))
    with scratch.vllm_files_here() as folder:
        assert len(str(folder)) + 37 > 107
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(long_dir)
        assert tempfile.gettempdir() == str(folder)  # the file store has no such limit


def test_a_run_that_exits_at_once_removes_the_folder(fresh):
    # `runner run` ends with os._exit, which runs no atexit handler (cli._exit_now)
    code = ("import os, tempfile, sys; tempfile.tempdir = sys.argv[1]\n"
            "from runner import scratch; from runner import cli\n"
            "print(scratch.scratch_dir(), flush=True)\n"
            "cli._exit_now('local')\n")
    out = subprocess.run([sys.executable, "-c", code, str(fresh)], capture_output=True, text=True, check=True)
    made = out.stdout.strip()
    assert made.startswith(str(fresh / "runner-tmp-"))
    assert not os.path.exists(made)


def test_a_killed_runs_row_ids_go_with_the_next_run(fresh):
    # the input's ids on disk (runner/row_ids.py) are as large as the input's ids
    code = ("import os, signal, sys, tempfile; tempfile.tempdir = sys.argv[1]\n"
            "from runner.row_ids import RowIds\n"
            "ids = RowIds(); ids.add(['a', 'b'])\n"
            "print(ids.path, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", code, str(fresh)], capture_output=True, text=True)
    left = Path(out.stdout.strip())
    assert out.returncode == -9 and left.exists() and left.parent.name.startswith("runner-tmp-")
    scratch.scratch_dir()  # the next run's
    assert not left.exists() and not left.parent.exists()
