"""What the finished requests' output lengths say about the running ones (for admission.py).

Short outputs finish first, so the lengths seen so far under-sample long ones. Only a cohort is a
fair sample: a length counts once every request admitted before it is done. The recent cohort
(at most 512 lengths: they change from one group of rows to the next) gives the percentiles and
the chance that a request still runs some steps from now.

Before enough of its own rows are done, a run may take the pace of its admissions (only the pace:
not the fit tests, which plan every row at max_tokens until then) from the lengths its stored
calibration's slice saw (seed): the same model, schema, prompt templates and sampling, but other
documents, so they may be stale. Seeds shorter than this run's outputs then only speed the pace up
to what the fit tests allow anyway; longer ones would slow it down until the run's own are known,
so seeds go as soon as SEED_CHECK of its own lengths fall outside their band, and in any case once
the run has counted enough of its own.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

WINDOW = 512  # recent lengths kept (the older half is dropped when full)
SEED_CHECK = 4  # own lengths after which seeds they contradict are dropped
BAND = 0.75  # seeds agree with own lengths within [BAND x their p10, their p90 / BAND] (the pace's test)


class Spread(NamedTuple):
    """Recent finished output lengths: percentiles (whole tokens) and mean."""

    p10: int
    p50: int
    p90: int
    mean: float


class OutputLengths:
    def __init__(self, min_samples: int):
        self.min_samples = min_samples  # lengths counted before any is trusted
        self.count = 0  # lengths counted in all
        self.total = 0  # ... and their sum
        self._recent: list[int] = []
        self._seeds: list[int] = []  # an earlier run's lengths, until this run's own are enough
        self.seeds_given = 0  # how many it was started with
        self._seed_spread: Optional[Spread] = None
        self._spread: Optional[Spread] = None  # of _recent, sorted once per change
        self._longer: Optional[np.ndarray] = None  # of _recent, for survival()
        self._finished: dict[int, Optional[int]] = {}  # done, but an earlier ticket is still running
        self._cohort_end = 0  # every ticket below this one is done and counted

    def finished(self, ticket: int, tokens: Optional[int]) -> None:
        """Ticket number `ticket` (in admission order) is done, with `tokens` output (None: it made
        none that count, e.g. the engine refused it)."""
        self._finished[ticket] = tokens
        while self._cohort_end in self._finished:
            n = self._finished.pop(self._cohort_end)
            self._cohort_end += 1
            if n is not None:
                self.total += n
                self.count += 1
                self._recent.append(n)
                self._spread = self._longer = None
                if self._seeds and (self.known() or (self.count >= SEED_CHECK and not self._seeds_agree())):
                    self._seeds = []  # this run's own lengths are enough, or say the earlier run's are stale
                if len(self._recent) > WINDOW:
                    del self._recent[:WINDOW // 2]

    def seed(self, lengths: list[int]) -> None:
        """Pace with an earlier run's lengths until this run has counted min_samples of its own
        (fewer than min_samples seeds are not taken: the pace would not read them)."""
        self._seeds = [int(n) for n in lengths[-WINDOW:]] if len(lengths) >= self.min_samples else []
        self.seeds_given = len(self._seeds)
        self._seed_spread = None

    @property
    def seeded(self) -> int:
        """Lengths from an earlier run the pace reads now (0 once this run's own are enough)."""
        return len(self._seeds)

    def recent(self) -> list[int]:
        """This run's own recent lengths."""
        return list(self._recent)

    def _seeds_agree(self) -> bool:
        seeds = self.pace_spread()
        return BAND * seeds.p10 <= min(self._recent) and max(self._recent) <= seeds.p90 / BAND

    def known(self) -> bool:
        """Enough of this run's own lengths counted to plan with them."""
        return self.count >= self.min_samples

    def spread(self) -> Optional[Spread]:
        """Percentiles and mean of this run's recent lengths (None: none counted yet), sorted once
        per change (admission asks on every request it considers)."""
        if self._spread is None and self._recent:
            self._spread = _spread(self._recent)
        return self._spread

    def pace_spread(self) -> Optional[Spread]:
        """What the pace reads: this run's own spread once known, else the seeds' (None: neither)."""
        if self.known():
            return self.spread()
        if len(self._seeds) < self.min_samples:
            return None
        if self._seed_spread is None:
            self._seed_spread = _spread(self._seeds)
        return self._seed_spread

    def survival(self, age: np.ndarray, cap: np.ndarray, ahead: np.ndarray) -> np.ndarray:
        """[request, x]: the chance that a request that has made age[r] tokens (of at most cap[r])
        still runs x steps later, for x in `ahead`. One longer than every recent length, or any
        before enough lengths are known, runs to its max_tokens."""
        later = age[:, None] + ahead[None, :]
        certain = (later < cap[:, None]).astype(float)
        if not self.known():
            return certain
        longer = self._longer_than()
        top = len(longer) - 1
        now, then = longer[np.minimum(age, top)], longer[np.minimum(later, top)]
        return np.where(now[:, None] > 0, then / np.maximum(now, 1)[:, None], 1.0) * certain

    def support_end(self, age: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """The age by which each request is surely done: the longest recent length, for one younger
        than it; else its max_tokens (cap)."""
        if not self.known():
            return cap
        longest = len(self._longer_than()) - 2
        return np.where(age < longest, np.minimum(cap, longest), cap)

    def _longer_than(self) -> np.ndarray:
        """How many recent lengths exceed v tokens, for v = 0 .. the longest (then 0)."""
        if self._longer is None:
            lengths = np.array(self._recent)
            counts = np.bincount(lengths, minlength=int(lengths.max()) + 2)
            self._longer = len(lengths) - np.cumsum(counts)
        return self._longer


def _spread(lengths: list[int]) -> Spread:
    ordered = sorted(lengths)
    at = [ordered[int(q * (len(ordered) - 1))] for q in (0.1, 0.5, 0.9)]
    return Spread(*at, sum(ordered) / len(ordered))
