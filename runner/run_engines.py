"""The engines of one run, started in turn (calibration may start several): their start, generation
time and counters are summed for the run's stats."""
from __future__ import annotations

import time
from typing import Callable, Optional

from runner.calibrate import Phase
from runner.engines import Engine, EngineCounters, Request
from runner.spec import Job
from runner.store import Store


class RunEngines:
    """Starts the engines of one run in turn and sums their load time, generation time and counters."""

    def __init__(self, job: Job, factory: Callable[[Job], Engine], store: Store, run_id: Optional[int],
                 clock: Callable[[], float] = time.perf_counter):
        self.job, self.factory, self.store, self.run_id = job, factory, store, run_id
        self.clock = clock  # injected: tests run calibration on a fake clock
        self.engine: Optional[Engine] = None
        self.load_s = self.gen_s = 0.0
        self.starts: list[float] = []  # seconds each engine took to start
        self.used = EngineCounters()
        self.adaptations: list[dict] = []
        self._before = EngineCounters()

    def start(self, job: Job) -> Engine:
        self.stop()
        t0 = self.clock()
        self.engine = self.factory(job)
        self.starts.append(self.clock() - t0)
        self.load_s += self.starts[-1]
        self._before = self.engine.counters()
        info = self.engine.info  # the last engine started runs the main pass: its settings are the run's
        if self.run_id is not None:
            self.store.set_engine(self.run_id, info.backend, info.version, info.settings)
        return self.engine

    @property
    def last_start_s(self) -> float:
        """What the last engine cost to start: the price of one more."""
        return self.starts[-1] if self.starts else 0.0

    def warmup(self, req: Request) -> None:
        """One throwaway request before a measured slice: one-time costs (the draft proposer's JIT
        compile, the schema's grammar) stay out of the measurement and out of the run's counters."""
        warm = getattr(self.engine, "warmup", None)
        if warm is not None:
            t0 = self.clock()
            warm(req)
            self.load_s += self.clock() - t0
            self._before = self.engine.counters()

    def run(self, loop, source, draft_tokens: int = 0) -> Phase:
        """Generate `source` on the current engine, handing each completion to `loop.finish`."""
        rows0, out0 = sum(loop.counts.values()), loop.tokens["completion"]
        c0, t0 = self.engine.counters(), self.clock()
        for c in self.engine.generate(source):
            loop.finish(c)
        loop.drain_immediate()
        dt = self.clock() - t0
        self.gen_s += dt
        return Phase(draft_tokens, sum(loop.counts.values()) - rows0, loop.tokens["completion"] - out0, dt,
                     self.engine.counters() - c0)

    def stop(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            try:
                self.used = self.used + (engine.counters() - self._before)
                self.adaptations.append({"settings": engine.info.settings, **engine.adaptation()})
            finally:
                engine.close()
