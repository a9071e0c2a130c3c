"""Admission waves (runner/engines/cadence.py) without vLLM: the step-cost fit, the wave it picks,
and the Feed holding admissions while a wave gathers."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from runner.engines.admission import KvBudget
from runner.engines.base import Request
from runner.engines.cadence import REFIT_EVERY, Cadence, best_wave
from runner.engines.feed import Feed


def test_a_costly_mixed_step_makes_waves_a_free_one_does_not():
    # 135M-like: 6 ms a decoding step, 4 ms more when a step prefills, 0.43 admissions a step.
    assert best_wave(0.006, 0.004, in_flight=43, per_step=0.43) > 2
    assert best_wave(0.006, 0.0, in_flight=43, per_step=0.43) == 1
    # A step dominated by the GPU (8B-like: 20 ms) makes a small extra cost not worth empty slots.
    assert best_wave(0.020, 0.0005, in_flight=100, per_step=0.4) == 1


def test_the_wave_grows_with_what_a_mixed_step_costs_and_leaves_most_slots_busy():
    waves = [best_wave(0.006, extra, in_flight=40, per_step=0.4) for extra in (0.001, 0.004, 0.016, 0.5)]
    assert waves == sorted(waves) and waves[0] < waves[-1]
    assert waves[-1] <= 40 * 0.25


def test_at_most_one_prefilling_step_a_step_is_counted():
    """Four admissions a step make one mixed step a step, not four: waves of up to 4 save nothing
    there and leave slots empty (counting r / k mixed steps, uncapped, would pick 4)."""
    assert best_wave(0.004, 0.001, in_flight=16, per_step=4.0) == 1


def simulate(cadence: Cadence, steps: int, c0: float, c1: float, extra: float, rng, per_token: float = 2e-6,
             stall: tuple[float, float] = (0.0, 0.0)) -> None:
    """Steps whose durations follow the model: requests sent at random polls, their prefill (a fixed
    extra and a cost a token) in the step after; that step stalls for stall[0] s with chance stall[1]."""
    t = [0.0]
    cadence.clock = lambda: t[0]
    prefill_tokens = None
    for _ in range(steps):
        in_flight = int(rng.integers(30, 50))
        t[0] += c0 + c1 * in_flight + rng.normal(0, 0.0002)
        if prefill_tokens is not None:
            t[0] += extra + per_token * prefill_tokens + (stall[0] if rng.random() < stall[1] else 0.0)
        prefill_tokens = None
        if rng.random() < 0.4:
            sizes = rng.integers(40, 400, size=int(rng.integers(1, 4)))
            for n in sizes:
                cadence.sent(int(n))
            prefill_tokens = int(sizes.sum())
        for _ in range(int(rng.random() < 0.45)):
            cadence.finished()
        cadence.stepped(in_flight)


def test_the_fit_recovers_what_a_mixed_step_costs():
    rng = np.random.default_rng(0)
    c = Cadence(True, clock=lambda: 0.0)
    simulate(c, 4 * REFIT_EVERY, c0=0.002, c1=0.0001, extra=0.004, rng=rng)
    assert c.fit["mixed_step_extra_ms"] == pytest.approx(4.0, rel=0.15)
    assert c.fit["decode_step_ms"] == pytest.approx(2.0 + 0.1 * 40, rel=0.1)
    assert c.fit["per_1k_prompt_tokens_ms"] == pytest.approx(2.0, rel=0.2)
    assert c.wave > 1


def test_a_few_long_pauses_do_not_make_waves():
    """Steps at no extra cost for prefilling, but one in ten steps after a send stalled for 50 ms (a
    metrics scan, the machine pausing): without the outliers dropped, the stalls read as a mixed
    step's cost and make waves."""
    rng = np.random.default_rng(2)
    c = Cadence(True, clock=lambda: 0.0)
    simulate(c, 4 * REFIT_EVERY, c0=0.004, c1=0.0001, extra=0.0, rng=rng, stall=(0.05, 0.1))
    assert c.fit["mixed_step_extra_ms"] < 0.5
    assert c.waves == [1, 1, 1]


def test_no_extra_cost_keeps_admissions_going_in_as_they_fit():
    rng = np.random.default_rng(1)
    c = Cadence(True, clock=lambda: 0.0)
    simulate(c, 4 * REFIT_EVERY, c0=0.004, c1=0.0001, extra=0.0, rng=rng)
    assert c.wave == 1


def test_waves_off_never_fits_or_holds():
    rng = np.random.default_rng(0)
    c = Cadence(False, clock=lambda: 0.0)
    simulate(c, 4 * REFIT_EVERY, c0=0.002, c1=0.0001, extra=0.004, rng=rng)
    assert c.wave == 1 and c.fit is None and not c.hold(in_flight=40, waiting=100)


def req(row):
    return Request(row, "g", list(range(100)), 32, 64)


def wave_feed(rows: int, wave: int, budget=None) -> tuple[Feed, Callable[[], list[str]]]:
    """A Feed whose cache holds six requests (4 + 6 x 6 blocks), `rows` waiting, a wave forced."""
    f = Feed(budget or KvBudget(4 + 6 * 6, 16, project=False), 64, 32, False, clock=lambda: 0.0, waves=True)
    f.cadence.wave = wave
    f.add([req(f"r{i}") for i in range(rows)])

    def send() -> list[str]:
        out = f.to_send()
        for a in out:
            f.sent(a.request.row_id, a)
        return [a.request.row_id for a in out]

    return f, send


def test_the_feed_holds_admissions_until_a_wave_has_finished_but_never_while_filling():
    """Filling goes at once; then, with a wave of 3, one or two finished requests let nothing in,
    the third lets three in together."""
    f, send = wave_feed(20, 3)
    assert send() == [f"r{i}" for i in range(6)]  # filling: not held, though the wave is 3
    f.finished("r0", 10)
    assert send() == []
    f.finished("r1", 10)
    assert send() == []
    f.finished("r2", 10)
    assert send() == ["r6", "r7", "r8"]
    assert f.cadence.holds == 2


def test_an_engine_with_no_more_than_a_wave_running_is_never_held():
    """With 4 running of a wave of 4, the others might never finish together: what fits goes in."""
    f, send = wave_feed(20, 4)
    send()
    f.finished("r0", 10)
    assert send() == []  # 5 running, 1 finished: held
    f.finished("r1", 10)
    assert send() == ["r6", "r7"]  # 4 running: not held


def test_the_last_rows_go_in_as_they_fit():
    """Fewer waiting than a wave: holding would only delay the end."""
    f, send = wave_feed(8, 3)
    send()
    f.finished("r0", 10)
    assert send() == ["r6"]


class PacedBudget(KvBudget):
    """A budget whose pace applies throughout and refuses while `paced` (admission.py's, forced)."""

    paced = False

    def _pace_allows(self, req, room) -> bool:
        self._bucket = 0.0 if self.paced else 1.0
        return not self.paced


def test_the_pace_is_never_taken_for_a_full_cache():
    """The pace spreads admissions out on purpose: a wave gathered behind it would leave the cache
    empty for a whole output length (the simulator, 8B shape: 5 requests in flight instead of 30)."""
    budget = PacedBudget(4 + 6 * 6, 16, project=True, pace=True)
    f, send = wave_feed(20, 3, budget)
    filled = send()
    budget.paced = True
    assert send() == []  # the pace refuses
    f.finished("r0", 10)
    assert send() == []  # still
    budget.paced = False
    assert send() == [f"r{len(filled)}"]  # one finished, the pace allows: in at once, no wave gathered


def test_a_fit_that_cannot_tell_the_costs_apart_leaves_the_wave_alone():
    """A send at every poll (no step without one) or prompts all of one length (tokens a multiple of
    the send): the mixed step's cost cannot be told from a decoding step's or from prefill work."""
    for every_poll, lengths in ((True, (40, 400)), (False, (236, 251))):
        rng = np.random.default_rng(3)
        c = Cadence(True, clock=lambda: 0.0)
        t = [0.0]
        c.clock = lambda: t[0]
        c.wave = 5
        for _ in range(4 * REFIT_EVERY):
            t[0] += 0.006 + rng.normal(0, 0.0002)
            if every_poll or rng.random() < 0.4:
                c.sent(int(rng.integers(*lengths)))
            if rng.random() < 0.4:
                c.finished()
            c.stepped(int(rng.integers(30, 50)))
        assert c.fit["undecided"] and c.wave == 5 and c.waves == []


def test_only_steps_taken_while_blocks_bind_go_to_the_fit():
    """A filling engine (everything fits) and a draining one (nothing waits) are not the regime waves
    are for: their steps would mislead the fit (on the CPU the ramp-up's first fit chose a wave of 8)."""
    f, send = wave_feed(8, 1)
    send()  # six fit, the seventh is refused: from here blocks bind
    f.stepped()
    f.stepped()
    assert len(f.cadence._rows) == 1  # the first step has no duration yet; the second counts
    for rid in ("r0", "r1"):
        f.finished(rid, 10)
    assert send() == ["r6", "r7"]  # the last rows: nothing waits, nothing binds
    f.stepped()
    assert len(f.cadence._rows) == 1


def test_no_wave_where_vllm_queues_what_it_is_sent():
    """With as many in flight as vLLM runs (max_num_seqs), what the runner sends waits in vLLM's
    queue and is prefilled as a slot frees: holding it back gathers nothing (on this project's CPU,
    72 in flight against 32 running, a fit read the finishes' refills as the sends' cost)."""
    f, send = wave_feed(20, 3, KvBudget(4 + 6 * 6, 16, project=False, max_running=5))
    assert len(send()) == 6
    f.finished("r0", 10)
    assert send() == ["r6"]  # 5 in flight of 5 running: not held
    f.stepped()
    f.stepped()
    assert len(f.cadence._rows) == 0
