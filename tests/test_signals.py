"""The runner's SIGTERM and SIGHUP handling as units: nesting, forked children, library calls."""
from __future__ import annotations

import os
import signal

import pytest

from runner.signals import Interrupted, handlers_kept, sigterm_interrupts


def test_the_outer_handler_and_its_message_stay_inside_an_inner_one():
    """A command's handler (here: one that stores no rows) stays in force through run_job's or
    calibrate's own: the message is the command's, and the process's handler comes back after."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        with sigterm_interrupts(""):
            with sigterm_interrupts():  # the run's, whose message promises stored rows
                os.kill(os.getpid(), signal.SIGTERM)
                signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the handler runs before the next line
    assert str(stopped.value) == "stopped by signal SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_forked_child_ends_by_the_signal_instead_of_raising_the_parents_error():
    """vLLM's engine core and workers are forked with the runner's SIGHUP handler: there a hang-up
    ends the process, as by default, not with the runner's Interrupted inside vLLM's loop."""
    with sigterm_interrupts():
        pid = os.fork()
        if pid == 0:  # the child: whatever happens, it never returns into pytest
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                os._exit(3)  # the handler raised nothing and the signal did not end it
            except BaseException:
                os._exit(4)  # the parent's Interrupted, raised in the child
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status


def test_a_library_that_sets_its_own_sigterm_handler_gives_it_back():
    """ray.init sets a SIGTERM handler that exits with no message: handlers_kept puts the runner's back."""
    with sigterm_interrupts(""):
        ours = signal.getsignal(signal.SIGTERM)
        with handlers_kept():
            signal.signal(signal.SIGTERM, lambda *_: None)  # what ray.init does
        assert signal.getsignal(signal.SIGTERM) is ours


def test_outside_the_command_line_stops_after_the_first_are_only_ignored():
    """A library's caller (a notebook, pytest) is not ended by a later Ctrl-C, and gets its
    handlers back when the stopped call returns."""
    before = signal.getsignal(signal.SIGINT)
    if before is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default here")
    alive = []
    with pytest.raises(KeyboardInterrupt):
        with sigterm_interrupts(""):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                signal.pthread_sigmask(signal.SIG_BLOCK, [])
            finally:  # the stop unwinds: further stops are ignored, and nothing ends the process
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGINT, signal.SIGINT):
                    os.kill(os.getpid(), s)
                    signal.pthread_sigmask(signal.SIG_BLOCK, [])
                alive.append(True)
    assert alive == [True] and signal.getsignal(signal.SIGINT) is before


QUITTER = """
import multiprocessing, os, signal, sys, time
from runner import signals

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    child.start()
    print(child.pid, flush=True)
    signals.keep_ignoring_after_stop()
    with signals.sigterm_interrupts(""):  # a command other than run: no rows to speak of
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        finally:
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGINT):
                os.kill(os.getpid(), s)
                time.sleep(0.2)
            print("not ended", flush=True)
"""


def test_in_the_command_line_the_second_ctrl_c_after_a_stop_quits_and_kills_the_engine_core(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "quitter.py"
    script.write_text(QUITTER)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    assert done.returncode == 130 and "not ended" not in done.stdout, done
    assert [ln for ln in done.stderr.splitlines() if ln] == ["Stopping: Ctrl-C again quits at once",
                                                             "Error: stopped again: quit at once"]
    child = int(done.stdout.split()[0])
    for _ in range(50):  # killed, then reaped by init: gone within moments
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        import time
        time.sleep(0.1)
    else:
        pytest.fail("the child outlived the quit")


def test_a_stop_inside_a_deferred_block_is_raised_as_it_ends_and_not_later():
    """stops_deferred (a batch's commit and its letting go): SIGTERM inside raises nothing there,
    then Interrupted as the block ends; a block that fails on its own raises its own error, and
    leaves no stop behind for the next block."""
    from runner.signals import stops_deferred

    reached = []
    with sigterm_interrupts():
        with pytest.raises(Interrupted):
            with stops_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the handler has run here
                reached.append("after the signal")
        assert reached == ["after the signal"]
    with sigterm_interrupts():
        with pytest.raises(OSError):
            with stops_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                signal.pthread_sigmask(signal.SIG_BLOCK, [])
                raise OSError("disk full")
        with stops_deferred():  # nothing left over from the block before
            reached.append("next block")
    assert reached[-1] == "next block"


def test_a_deferred_block_in_another_thread_does_not_hold_the_main_threads_stop():
    """Handlers run in the main thread: a block in a worker thread deferred the main thread's stop
    and raised it in the worker, while the main thread went on."""
    import threading
    import time

    from runner.signals import stops_deferred

    entered, release, got = threading.Event(), threading.Event(), {}

    def worker():
        try:
            with stops_deferred():
                entered.set()
                release.wait(5)
            got["worker"] = "no stop"
        except BaseException as exc:  # noqa: BLE001 - what the worker saw is the result
            got["worker"] = repr(exc)

    with sigterm_interrupts():
        t = threading.Thread(target=worker)
        t.start()
        entered.wait(5)
        try:
            with pytest.raises(Interrupted):
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(100):
                    time.sleep(0.01)
        finally:
            release.set()
            t.join()
    assert got == {"worker": "no stop"}


def test_reset_inside_a_deferred_block_leaves_later_stops_raised():
    from runner import signals
    from runner.signals import stops_deferred

    with stops_deferred():
        signals.reset()
    with pytest.raises(Interrupted):
        with sigterm_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])
