"""When a command began, for the wall time a run stores: the user's clock starts when the process
does, before the runner reads its input or measures anything."""
from __future__ import annotations

import os
import time
from typing import Optional

_start: dict = {}  # the entry point's reading, taken by the first command that asks


def process_age_s(stat: str = "/proc/self/stat", uptime: str = "/proc/uptime") -> float:
    """Seconds since this process was created (fork, so a wrapper's exec into it counts from the
    wrapper's fork), from Linux's /proc to the clock tick; 0.0 where unknown (another OS)."""
    try:
        with open(stat, "rb") as f:
            raw = f.read()
        # after "pid (comm) ": state is field 3, starttime field 22; comm may hold spaces and ")"
        start_ticks = int(raw[raw.rindex(b")") + 2:].split()[19])
        with open(uptime, encoding="ascii") as f:
            up_s = float(f.read().split()[0])
        return max(0.0, up_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def note_process_start() -> None:
    """At the entry point, once a process: when it started, on time.perf_counter's scale."""
    if "noted" not in _start:
        age = process_age_s()
        _start.update(noted=True, at=time.perf_counter() - age, source="process" if age > 0 else "command")


def take_start() -> tuple[float, str]:
    """(when the command began, where that was read): the process's start for the first command
    of a process whose entry point noted it, else now ("command"). Later commands run in the same
    process (tests calling the entry point) count from their own start."""
    at: Optional[float] = _start.pop("at", None)
    if at is None:
        return time.perf_counter(), "command"
    return at, _start.pop("source")
