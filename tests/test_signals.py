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
