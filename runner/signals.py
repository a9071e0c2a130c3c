"""SIGTERM (cron's and systemd's stop) and SIGHUP as the runner's own Interrupted error, raised in the main
thread wherever the run is, so that what finished is stored and the exit says so."""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading

from runner.errors import RunnerError


class Interrupted(RunnerError):
    """The run was stopped by SIGTERM or Ctrl-C; what finished is stored."""

    exit_code = 130


RUN_STOPPED = "finished rows are stored, rerun to resume"


_state = {"stopping": False, "keep": False, "ctrl_c": 0, "after": "", "deferring": 0, "deferred": None}


def raise_interrupted(signum, _frame, after: str = RUN_STOPPED, pid: int = 0):
    """The SIGTERM handler: the runner's own Interrupted, raised where the main thread is; `after`
    says what the stop left (a run: its finished rows). In a process forked from the one that set
    it (vLLM's engine core and workers keep SIGHUP's handler), the signal's default: it ends."""
    if pid and os.getpid() != pid:
        _default(signum)
        return
    _ignore_stops(after)
    stop = Interrupted(f"stopped by signal {signal.Signals(signum).name}" + (f"; {after}" if after else ""))
    if _state["deferring"]:  # a batch being committed: raised once it is (stops_deferred)
        _state["deferred"] = stop
        return
    raise stop


def raise_keyboard_interrupt(signum, frame, pid: int = 0, after: str = ""):
    """The SIGINT handler: Python's own KeyboardInterrupt, after which further stops are ignored
    (a second Ctrl-C while the first unwinds lost the open batch and printed a traceback)."""
    if pid and os.getpid() != pid:
        signal.default_int_handler(signum, frame)
    _ignore_stops(after)
    if _state["deferring"]:
        _state["deferred"] = KeyboardInterrupt()
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def stops_deferred(raise_after: bool = True):
    """A stop (SIGTERM, SIGHUP; Ctrl-C where sigterm_interrupts set its handler) that arrives inside
    is acted on as the block ends: a batch of rows is committed and let go of together, or neither.
    Raised between the commit and the letting go, it left the batch to be stored again as the stop
    unwound: each of its rows a second time in results_history, and counted twice among the rows
    the run redid. raise_after=False:
    such a stop is only ignored (recording a failure the process ends with anyway). Handlers run in
    the main thread only: elsewhere the block defers nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state["deferring"] += 1
    stop = None
    try:
        yield
    finally:  # the block's own error, if any, goes on instead (the stop is under way, stops ignored)
        _state["deferring"] = max(0, _state["deferring"] - 1)  # reset() inside leaves no debt
        if not _state["deferring"]:
            stop, _state["deferred"] = _state["deferred"], None
    if stop is not None and raise_after:
        raise stop


def _default(signum) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _ignored(signum, _frame, pid: int) -> None:
    """A stop after the first: ignored, by a handler of Python's own, not SIG_IGN (a signal that
    arrived as SIG_IGN was set is raised as OSError "Signal 15 ignored due to race condition").
    In the command line's process, Ctrl-C is the way out of a shutdown that hangs: the first one
    after the stop says so, the next ends the process at once (exit 130; a run's rows not stored
    yet are lost, its run row is left for the next run). A shutdown stuck outside Python (in C)
    runs no handler: SIGKILL is left for that."""
    if os.getpid() != pid:  # a forked child (vLLM's engine core): the signal's default
        _default(signum)
        return
    if signum != signal.SIGINT or not _state["keep"]:  # a library's caller (a notebook) is not ended
        return
    _state["ctrl_c"] += 1
    run = _state["after"] == RUN_STOPPED
    _say("\nStopping: " + ("storing the finished rows; " if run else "") + "Ctrl-C again quits at once"
         + (" (the rows not stored yet are lost)\n" if run else "\n") if _state["ctrl_c"] == 1 else
         "\nError: stopped again: quit at once" + ("; rerun to resume\n" if run else "\n"))
    if _state["ctrl_c"] > 1:
        _quit_now()


def _say(text: str) -> None:
    """A line to the runner's standard error from a signal handler: written unbuffered (the handler
    may run inside a write to the same stream), and dropped if it cannot be written."""
    from runner.console import console  # imported already: the run's streams (fd 2 may be the engine's log)

    try:
        console().err.flush()
        os.write(console().err.fileno(), text.encode(errors="replace"))
    except Exception:  # noqa: BLE001 - a note must not raise into the code storing rows
        pass


def _quit_now() -> None:
    """End the process at once: its engine core, a child of its own, is killed first (it would
    hold the GPU, as nothing in it watches this process), then the scratch folder goes."""
    import multiprocessing

    from runner.scratch import remove_scratch

    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
    with contextlib.suppress(Exception):
        remove_scratch()
    os._exit(130)


def _ignore_stops(after: str = "") -> None:
    """A second SIGTERM, SIGHUP or Ctrl-C while the first stop unwinds (storing the open batch,
    marking the run) is ignored: raised again, it would lose that batch and leave the run row
    `running`. sigterm_interrupts puts the handlers back as it ends, unless the process ends with
    the command (keep_ignoring_after_stop)."""
    _state.update(stopping=True, after=after)
    _ignore(_STOPS)


def _ignore(signals) -> None:
    handler = functools.partial(_ignored, pid=os.getpid())
    for s in signals:
        if s is not None and signal.getsignal(s) is not signal.SIG_IGN:  # `nohup`'s SIGHUP stays ignored
            signal.signal(s, handler)


def keep_ignoring_after_stop() -> None:
    """For the command line, whose process ends with its command: once stopped, further stops are
    ignored to the exit. Put back as the command unwinds, a second signal there ended the process
    by the signal (not 130) or printed a KeyboardInterrupt traceback."""
    _state["keep"] = True


def reset() -> None:
    """No stop under way, and handlers put back as ever: for a process that goes on after a
    command's main() (tests)."""
    _state.update(stopping=False, keep=False, ctrl_c=0, after="", deferring=0, deferred=None)


_STOPS = (signal.SIGTERM, getattr(signal, "SIGHUP", None), signal.SIGINT)


def _ours(handler) -> bool:
    return isinstance(handler, functools.partial) and handler.func is raise_interrupted


@contextlib.contextmanager
def sigterm_interrupts(after: str = RUN_STOPPED):
    """SIGTERM raises Interrupted from the first step on (a wait for the lock, the grammar's
    measuring child, which subprocess.run then kills), not only once the run row exists: cron and
    systemd see exit 130 and one Error: line rather than a bare death by signal. Only the main
    thread can set a handler: called from another thread, the process's own handling stays. Set
    already (the command's, around a run's): that one stays, its message and its ignoring a
    second signal."""
    if (threading.current_thread() is not threading.main_thread() or _ours(signal.getsignal(signal.SIGTERM))
            or _state["stopping"]):  # stopped already: further stops stay ignored
        yield
        return
    # SIGHUP too (a closed terminal or ssh session), unless ignored: `nohup runner run` asked that
    signals = [signal.SIGTERM] + [s for s in [getattr(signal, "SIGHUP", None)]
                                  if s is not None and signal.getsignal(s) is not signal.SIG_IGN]
    handler = functools.partial(raise_interrupted, after=after, pid=os.getpid())
    old = {s: signal.signal(s, handler) for s in signals}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (`cmd &`)
        old[signal.SIGINT] = signal.signal(signal.SIGINT, functools.partial(raise_keyboard_interrupt, pid=os.getpid(),
                                                                             after=after))
    try:
        yield
    finally:
        _put_back(old)


@contextlib.contextmanager
def handlers_kept():
    """Leave SIGTERM's and SIGHUP's handlers as they were across a library call that sets its own
    (ray.init: Ray's SIGTERM handler exits with no message and the run recorded failed)."""
    signals = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    main = threading.current_thread() is threading.main_thread()
    old = {s: signal.getsignal(s) for s in signals} if main else {}
    try:
        yield
    finally:
        _put_back({s: handler for s, handler in old.items() if handler is not None})


def _put_back(old: dict) -> None:
    """The handlers as they were; not once a stop began in a process that ends with its command."""
    if _state["stopping"] and _state["keep"]:
        _ignore(old)  # ignoring to the exit, whatever a library (ray.init) set meanwhile
        return
    _state.update(stopping=False, ctrl_c=0)
    for s, handler in old.items():
        signal.signal(s, handler)


def ignore_stop_signals(ctrl_c: bool = False) -> None:
    """SIGTERM and SIGHUP (and SIGINT with ctrl_c) ignored from here on (a run that completed, or
    one stopped: what is left is its exit)."""
    if threading.current_thread() is threading.main_thread():
        _state["stopping"] = True  # not put back as the command unwinds (keep_ignoring_after_stop)
        _ignore((signal.SIGTERM, getattr(signal, "SIGHUP", None)) + ((signal.SIGINT,) if ctrl_c else ()))
