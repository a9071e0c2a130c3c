"""SIGTERM (cron's and systemd's stop) and SIGHUP as the runner's own Interrupted error, raised in the main
thread wherever the run is, so that what finished is stored and the exit says so."""
from __future__ import annotations

import contextlib
import functools
import signal
import threading

from runner.errors import RunnerError


class Interrupted(RunnerError):
    """The run was stopped by SIGTERM or Ctrl-C; what finished is stored."""

    exit_code = 130


RUN_STOPPED = "finished rows are stored, rerun to resume"


def raise_interrupted(signum, _frame, after: str = RUN_STOPPED):
    """The SIGTERM handler: the runner's own Interrupted, raised where the main thread is; `after`
    says what the stop left (a run: its finished rows)."""
    # A second SIGTERM while the first unwinds (storing the open batch, marking the run) is ignored:
    # raised again, it would lose that batch and leave the run row `running`.
    signal.signal(signum, signal.SIG_IGN)
    raise Interrupted(f"stopped by signal {signal.Signals(signum).name}" + (f"; {after}" if after else ""))


@contextlib.contextmanager
def sigterm_interrupts(after: str = RUN_STOPPED):
    """SIGTERM raises Interrupted from the first step on (a wait for the lock, the grammar's
    measuring child, which subprocess.run then kills), not only once the run row exists: cron and
    systemd see exit 130 and one Error: line rather than a bare death by signal. Only the main
    thread can set a handler: called from another thread, the process's own handling stays."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # SIGHUP too (a closed terminal or ssh session), unless ignored: `nohup runner run` asked that
    signals = [signal.SIGTERM] + [s for s in [getattr(signal, "SIGHUP", None)]
                                  if s is not None and signal.getsignal(s) is not signal.SIG_IGN]
    handler = raise_interrupted if after == RUN_STOPPED else functools.partial(raise_interrupted, after=after)
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
