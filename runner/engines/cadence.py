"""Admission waves: gather admissions into fewer engine steps where a step that prefills costs
more than one that only decodes (no vLLM in here: unit-tested on its own).

vLLM replays one CUDA graph for a step that only decodes; a step that also prefills (a newly
admitted request's prompt) runs piecewise or eagerly, layer by layer from Python. A py-spy profile
of plain vLLM 0.26 on the H200 (135M model, rows sorted by prompt, tight cache) found full-graph
replays in 9 of 3,304 engine-core samples: a finished request's blocks went to a waiting one at
once, so nearly every step prefilled something. Admitting k requests together makes one such step
out of k, at the price of slots left empty while the wave gathers.

What a mixed step costs is measured in the run itself: a least-squares fit of each step's duration
on the requests in flight, the requests that finished in it (the driver's work on them) and, for
this poll and each of the two before (vLLM prefills a request one or two steps after it arrives),
on whether requests were sent and on the prompt tokens they prefill (work a wave does not save).
The wave then minimises the modelled time per output token, (t + a min(1, r / k)) / (N - h), with
h = (k - 1) / 2 slots empty on average: N requests in flight at full strength, r admissions a step,
a the mixed step's extra cost and t a decoding step's, taken as fixed (an empty slot saves none of
it: the cautious reading, as requests in flight barely vary where the cache binds and the fit cannot
split t by request). The fit decides only where it can: enough steps with and without sends, and
columns far from collinear (a send at every poll, prompts all of one length); else the wave stays.
Where prefilling costs nothing extra (a CPU engine runs every step eagerly) the wave stays 1:
requests go in as soon as they fit, as without waves (in the admission simulator, with step times
30% noisy, one seed of three still fitted a small cost and held waves, 0.3% slower).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable, Optional

import numpy as np

WINDOW = 512  # steps the fit looks back over
REFIT_EVERY = 128  # recorded steps between fits (the first after this many)
LAGS = 3  # polls whose sends may show in a step's duration: this one and the two before
MIN_GAIN = 0.03  # a wave must model at least this much less time a token than none (else noise)
MAX_SHARE = 0.25  # of the requests in flight, at most this many slots wait for a wave
OUTLIER_MADS = 4.0  # steps further than this from the first fit (in robust deviations) are refitted without
MIN_SHARE = 0.1  # of the window's steps, at least this many with sends and this many without, to decide
MAX_CONDITION = 30.0  # of the standardised design matrix: beyond it the columns are too alike to decide
HISTORY = 64  # waves chosen, kept for the run's stats


def best_wave(step_s: float, mixed: float, in_flight: float, per_step: float) -> int:
    """The wave size k minimising (step_s + mixed min(1, r / k)) / (N - h), h = (k - 1) / 2; 1
    unless it models at least MIN_GAIN less time per output token than k = 1."""
    top = max(1, int(in_flight * MAX_SHARE))
    if in_flight < 2 or per_step <= 0 or mixed <= 0 or step_s <= 0:
        return 1

    def per_token(k: int) -> float:
        return (step_s + mixed * min(1.0, per_step / k)) / (in_flight - (k - 1) / 2)

    best = min(range(1, top + 1), key=per_token)
    return best if per_token(best) <= (1 - MIN_GAIN) * per_token(1) else 1


class Cadence:
    """Measures steps and says when admissions wait to go in together (see the module's docstring)."""

    def __init__(self, enabled: bool, clock: Callable[[], float]):
        self.enabled, self.clock = enabled, clock
        self.wave = 1
        self.freed = 0  # requests finished since requests last went in from the queue
        self.holds = 0  # polls in which admissions waited for the wave
        self.fit: Optional[dict] = None  # the latest fit (or why it did not decide)
        self.waves: list[int] = []  # the wave each fit chose, the latest HISTORY of them
        self._pending = [0, 0]  # requests and their prefill tokens sent since the last step
        self._sent: deque[tuple[int, int]] = deque([(0, 0)] * LAGS, maxlen=LAGS)  # newest first
        self._rows: deque[tuple] = deque(maxlen=WINDOW)
        self._new_rows = 0
        self._finished = 0
        self._last: Optional[float] = None

    def hold(self, in_flight: int, waiting: int) -> bool:
        """True while the next wave gathers: fewer than `wave` requests finished since the last
        admissions, more than `wave` running (an engine that drains is never held: with none running,
        none would finish) and a wave's worth waiting (the last rows go in as they fit)."""
        if self.wave <= 1 or self.freed >= self.wave or waiting < self.wave or in_flight <= self.wave:
            return False
        self.holds += 1
        return True

    def gathered(self) -> None:
        """Requests went in from the queue: the next wave gathers from here."""
        self.freed = 0

    def sent(self, tokens: int) -> None:
        """One request went to the engine, with this many prompt tokens to prefill."""
        self._pending[0] += 1
        self._pending[1] += tokens

    def finished(self) -> None:
        self.freed += 1
        self._finished += 1

    def stepped(self, in_flight: int, record: bool = True) -> None:
        """The engine made a step (`in_flight` requests left in it): its duration since the last step
        ended joins the fit's window if `record`."""
        if not self.enabled:
            return
        now = self.clock()
        self._sent.appendleft((self._pending[0], self._pending[1]))
        self._pending = [0, 0]
        if self._last is not None and record:
            mixed = [1.0 if n else 0.0 for n, _ in self._sent]
            tokens = [float(t) for _, t in self._sent]
            self._rows.append((now - self._last, in_flight + self._finished, self._finished, *mixed, *tokens))
            self._new_rows += 1
        self._finished = 0
        if self._new_rows >= REFIT_EVERY:
            self._new_rows = 0
            self._refit()
        self._last = self.clock()  # after the fit: its own time is not a step's

    def _refit(self) -> None:
        rows = np.array(self._rows, dtype=float)
        duration, in_flight, finished = rows[:, 0], rows[:, 1], rows[:, 2]
        mixed_cols = rows[:, 3:3 + LAGS]
        x = np.column_stack([np.ones(len(rows)), in_flight, finished, mixed_cols, rows[:, 3 + LAGS:]])
        quiet = float((mixed_cols.sum(axis=1) == 0).mean())
        spread = x[:, 1:].std(axis=0)
        kept = x[:, 1:][:, spread > 0]
        standard = (kept - kept.mean(axis=0)) / kept.std(axis=0)
        condition = float(np.linalg.cond(standard)) if kept.shape[1] else math.inf
        if not MIN_SHARE <= quiet <= 1 - MIN_SHARE or not (spread[2:2 + LAGS] > 0).all() or condition > MAX_CONDITION:
            self.fit = {"steps": len(rows), "undecided": True, "steps_without_sends": round(quiet, 3),
                        "condition": round(condition, 1)}
            return
        coef = np.linalg.lstsq(x, duration, rcond=None)[0]
        # Once more without the outliers (a metrics scan, a pause of the machine): a few long steps
        # must not decide the wave.
        residual = np.abs(duration - x @ coef)
        keep = residual <= OUTLIER_MADS * 1.4826 * np.median(residual) + 1e-9
        if keep.sum() >= x.shape[1] * 8:
            coef = np.linalg.lstsq(x[keep], duration[keep], rcond=None)[0]
        n = float(in_flight.mean())
        step_s = float(coef[0] + coef[1] * n)  # a decoding step with the window's mean in flight
        mixed = max(float(coef[3:3 + LAGS].sum()), 0.0)
        per_step = float(finished.mean())
        # In flight at full strength: the wave in force left (wave - 1) / 2 slots empty on average.
        self.wave = best_wave(step_s, mixed, n + (self.wave - 1) / 2, per_step)
        self.waves = (self.waves + [self.wave])[-HISTORY:]
        self.fit = {"steps": len(rows), "decode_step_ms": round(step_s * 1e3, 3),
                    "mixed_step_extra_ms": round(mixed * 1e3, 3),
                    "per_finished_ms": round(float(coef[2]) * 1e3, 3),
                    "per_1k_prompt_tokens_ms": round(float(coef[3 + LAGS:].sum()) * 1e6, 3),
                    "in_flight": round(n, 1), "finished_per_step": round(per_step, 3),
                    "steps_without_sends": round(quiet, 3), "condition": round(condition, 1)}

    def describe(self) -> dict:
        return {"wave": self.wave, "wave_holds": self.holds, "wave_fit": self.fit, "waves_fitted": self.waves}
