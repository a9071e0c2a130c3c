"""The benchmark's child processes: a timeout or a stopped bench leaves no grandchild behind (an
engine core holding a GPU's memory made the next run on that GPU fail to start)."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bench import procs

# A parent that starts a long-lived child (as a run starts vLLM's engine core) and writes its pid.
PARENT = "sleep 300 & echo $! > {pidfile}; wait"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        # A killed child of an exited parent may linger as a zombie until init reaps it.
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def wait_gone(pid: int, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def read_pid(pidfile, seconds: float = 5.0) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pidfile.exists() and pidfile.read_text().strip():
            return int(pidfile.read_text())
        time.sleep(0.05)
    raise AssertionError("the parent never started its child")


def test_a_finished_run_returns_its_status_and_output():
    done = procs.run_group(["sh", "-c", "echo hi; echo err >&2; exit 3"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "hi\n", "err\n")


def test_a_timeout_kills_the_child_of_the_run_too(tmp_path):
    pidfile = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run_group(["sh", "-c", PARENT.format(pidfile=pidfile)], timeout=1)
    assert wait_gone(read_pid(pidfile))
    assert not procs._LIVE


def test_a_child_left_behind_by_a_run_that_exited_is_killed(tmp_path):
    pidfile = tmp_path / "pid"
    # The parent exits at once; its child (in the same group) would outlive it.
    procs.run_group(["sh", "-c", f"sleep 300 & echo $! > {pidfile}"])
    assert wait_gone(read_pid(pidfile))


@pytest.fixture(autouse=True)
def not_stopping():
    yield
    procs._STOPPING.clear()


def test_stopping_the_bench_kills_every_running_group(tmp_path):
    pidfile = tmp_path / "pid"
    runner = threading.Thread(target=lambda: procs.run_group(["sh", "-c", PARENT.format(pidfile=pidfile)]),
                              daemon=True)
    runner.start()
    child = read_pid(pidfile)
    with pytest.raises(SystemExit) as stopped:
        procs.stop_all(signal.SIGTERM)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert wait_gone(child)
    runner.join(5)
    assert not runner.is_alive()


def test_a_run_started_while_the_bench_stops_is_stopped_at_once(tmp_path):
    procs._STOPPING.set()
    done = procs.run_group(["sleep", "300"])  # without the stop: 300 s
    assert done.returncode in (-signal.SIGTERM, -signal.SIGKILL)


BENCH = """
import sys, time
sys.path.insert(0, {root!r})
from bench import procs
procs.install_handlers()
print("ready", flush=True)
procs.run_group(["sh", "-c", {parent!r}])
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_bench_stops_its_runs(tmp_path, sig):
    """A real signal, through the handlers a bench installs: the bench exits as the signal would
    and the run's child is gone."""
    from pathlib import Path

    pidfile = tmp_path / "pid"
    script = BENCH.format(root=str(Path(__file__).resolve().parents[1]), parent=PARENT.format(pidfile=pidfile))
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout.readline().strip() == "ready"
        child = read_pid(pidfile)
        bench.send_signal(sig)
        assert bench.wait(timeout=30) == 128 + sig
        assert wait_gone(child)
    finally:
        bench.kill()
