"""The run's progress bar: it counts every stored row, and its clock starts when the engine is up."""
from __future__ import annotations

import io

from runner.console import RunBar
from runner.engines.fake import FakeEngine
from runner.run import run_job
from runner.spec import load_job
from tests.test_calibration_cache import auto_job, harness


class Recorder:
    """A progress bar that keeps what the run told it, in order."""

    def __init__(self, total: int, events: list):
        self.total, self.events = total, events
        self.events.append(("created", total))

    def engine_started(self) -> None:
        self.events.append(("started",))

    def update(self, n: int = 1) -> None:
        self.events.append(("update", n))

    def close(self) -> None:
        self.events.append(("closed",))


def test_the_bar_hears_of_the_engine_before_any_row_and_counts_each_row_once(make_job):
    job = load_job(make_job(rows=12))
    events: list = []
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema),
            progress_factory=lambda total: Recorder(total, events))
    assert events[0] == ("created", 12) and events[1] == ("started",) and events[-1] == ("closed",)
    assert sum(e[1] for e in events if e[0] == "update") == 12


def test_each_engine_of_a_calibrating_run_tells_the_bar(make_job):
    job = auto_job(make_job)  # measures 0 and 4 draft tokens: two engines
    clock, started, factory = harness()
    events: list = []
    run_job(job, engine_factory=factory, clock=lambda: clock.now,
            progress_factory=lambda total: Recorder(total, events))
    assert started == [0, 4]
    kinds = [e[0] for e in events]
    assert kinds.count("started") == 2 and kinds.index("started") < kinds.index("update")
    assert sum(e[1] for e in events if e[0] == "update") == 40


def test_a_run_with_nothing_left_to_do_shows_no_bar(make_job):
    job = load_job(make_job(rows=5))
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema))
    events: list = []
    again = run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema),
                    progress_factory=lambda total: Recorder(total, events))
    assert again.rows_skipped == 5 and events == []


def test_the_bar_restarts_its_clock_at_the_first_engine_only():
    out = io.StringIO()
    bar = RunBar(10, "summarize", out, mininterval=0.0)
    assert bar.bar.desc.startswith("summarize (starting the engine)")
    bar.bar.start_t -= 100  # as if vLLM took 100 s to import and start
    bar.engine_started()
    assert bar.bar.desc == "summarize" and bar.bar.n == 0 and bar.bar.total == 10
    assert bar.bar.format_dict["elapsed"] < 50
    bar.update(3)
    bar.bar.start_t -= 100  # calibration's second engine: the count and the clock go on
    bar.engine_started()
    assert bar.bar.n == 3 and bar.bar.format_dict["elapsed"] >= 100
    bar.close()
    assert "summarize: 100%" not in out.getvalue() and "3/10" in out.getvalue()
