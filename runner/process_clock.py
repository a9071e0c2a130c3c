"""How long this process has run. `runner run` stores its wall time from the moment the process
started, as the user's clock counts it, not from when generation's bookkeeping began: reading the
input, checking the database and measuring the grammar backend come first (18-20 s of a first run
on the H200 host, outside the stored wall until the lease of e916717 showed it)."""
from __future__ import annotations

import os
import time
from typing import Callable


def process_age_s(stat: str = "/proc/self/stat", uptime: str = "/proc/uptime") -> float:
    """Seconds since this process started (Linux's /proc, to the clock tick); 0.0 where unknown."""
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


def process_started(clock: Callable[[], float] = time.perf_counter) -> float:
    """The reading of `clock` at which this process started."""
    return clock() - process_age_s()
