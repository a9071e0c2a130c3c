"""The engines of one run, started one after another (calibration may start several): their start
times, generation time and counters are summed for the run's stats."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from runner.engines.base import Engine, EngineCounters, EngineInfo, Request


@dataclass
class Phase:
    """One measured slice of the job."""

    draft_tokens_setting: int  # 0: no speculation
    rows: int
    output_tokens: int
    generation_s: float
    counters: EngineCounters = field(default_factory=EngineCounters)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.generation_s if self.generation_s > 0 else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Share of drafts whose i-th token was accepted (which needs every earlier one accepted)."""
        drafts = self.counters.spec_drafts
        return [a / drafts for a in self.counters.spec_accepted_per_pos] if drafts else []

    def to_dict(self) -> dict:
        d = asdict(self)
        d["output_tokens_per_s"] = round(self.output_tokens_per_s, 2)
        d["acceptance_by_position"] = [round(a, 4) for a in self.acceptance_by_position()]
        return d


class EngineSequence:
    """Starts the engines of one run in turn and sums their load time, generation time and counters."""

    def __init__(self, factory: Callable, on_start: Optional[Callable[[EngineInfo], None]] = None,
                 clock: Callable[[], float] = time.perf_counter, let_go_last: bool = False):
        self.factory, self.on_start = factory, on_start
        self.let_go_last = let_go_last  # the process ends after a completed run: do not wait for the last engine
        self.clock = clock  # injected: tests run calibration on a fake clock
        self.engine: Optional[Engine] = None
        self.speculative: Optional[dict] = None
        self.load_s = self.gen_s = 0.0
        self.starts: list[float] = []  # seconds each engine took to start
        self.used = EngineCounters()
        self.adaptations: list[dict] = []
        self._before = EngineCounters()

    def start(self, job) -> Engine:
        self.stop()
        spec = job.engine.speculative
        self.speculative = spec.model_dump() if hasattr(spec, "model_dump") else None  # what the engine drafts with
        t0 = self.clock()
        self.engine = self.factory(job)
        self.starts.append(self.clock() - t0)
        self.load_s += self.starts[-1]
        self._before = self.engine.counters()
        if self.on_start is not None:  # the last engine started runs the main pass: its settings are the run's
            self.on_start(self.engine.info)
        return self.engine

    @property
    def last_start_s(self) -> float:
        """What the last engine cost to start: the price of one more."""
        return self.starts[-1] if self.starts else 0.0

    def warmup(self, req: Request) -> None:
        """One throwaway request before a measured slice: one-time costs (the draft proposer's JIT
        compile, the schema's grammar) stay out of the measurement and out of the run's counters."""
        t0 = self.clock()
        self.engine.warmup(req)
        self.load_s += self.clock() - t0
        self._before = self.engine.counters()

    def run(self, collector, source, draft_tokens: int = 0) -> Phase:
        """Generate `source` on the current engine, handing each completion to `collector.finish`."""
        rows0, out0 = collector.rows_done, collector.tokens["completion"]
        c0, t0 = self.engine.counters(), self.clock()
        try:
            for c in self.engine.generate(source):
                collector.finish(c)
        finally:  # a run stopped midway still counts the generation it did
            dt = self.clock() - t0
            self.gen_s += dt
        return Phase(draft_tokens, collector.rows_done - rows0, collector.tokens["completion"] - out0, dt,
                     self.engine.counters() - c0)

    def stop(self, completed: bool = False) -> None:
        """Close the current engine; the last one of a completed run is let go when the process
        ends right after it (see Engine.let_go)."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            try:
                self.used = self.used + (engine.counters() - self._before)
                self.adaptations.append({"settings": engine.info.settings, **engine.adaptation()})
            finally:
                engine.let_go() if completed and self.let_go_last else engine.close()
