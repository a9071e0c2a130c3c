"""What the finished requests' output lengths say about the running ones (for admission.py).

Short outputs finish first, so the lengths seen so far under-sample long ones. Only a cohort is a
fair sample: a length counts once every request admitted before it is done. The recent cohort
(at most 512 lengths: they change from one group of rows to the next) gives the percentiles and
the chance that a request still runs some steps from now.

Before any of its own rows is done, a run may start from the lengths its stored calibration's slice
saw (seed): the same model, schema, prompts and sampling. They stand in only until the run has
counted enough lengths of its own, so that admission paces from the first row instead of admitting
a convoy by peaks; then they are dropped.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

WINDOW = 512  # recent lengths kept (the older half is dropped when full)


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
        self._spread: Optional[Spread] = None  # of the sample (seeds and recent), sorted once per change
        self._longer: Optional[np.ndarray] = None  # of the sample, for survival()
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
                if self._seeds and self.count >= self.min_samples:
                    self._seeds = []  # this run's own lengths are enough: the earlier run's go
                if len(self._recent) > WINDOW:
                    del self._recent[:WINDOW // 2]

    def seed(self, lengths: list[int]) -> None:
        """Plan with an earlier run's lengths until this run has counted min_samples of its own."""
        self._seeds = [int(n) for n in lengths[-WINDOW:]]
        self.seeds_given = len(self._seeds)
        self._spread = self._longer = None

    @property
    def seeded(self) -> int:
        """Lengths from an earlier run planned with now (0 once this run's own are enough)."""
        return len(self._seeds)

    def recent(self) -> list[int]:
        """This run's own recent lengths (seeds left out)."""
        return list(self._recent)

    def _sample(self) -> list[int]:
        """The lengths planned with: the seeds while they stand in, and this run's own."""
        return self._seeds + self._recent if self._seeds else self._recent

    def known(self) -> bool:
        """Enough lengths counted (or seeded) to plan with them."""
        return self.count + len(self._seeds) >= self.min_samples

    def spread(self) -> Optional[Spread]:
        """Percentiles and mean of the recent lengths (None: none counted yet), sorted once per
        change (admission asks on every request it considers)."""
        sample = self._sample() if self._spread is None else None
        if sample:
            recent = sorted(sample)
            at = [recent[int(q * (len(recent) - 1))] for q in (0.1, 0.5, 0.9)]
            self._spread = Spread(*at, sum(recent) / len(recent))
        return self._spread

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
            lengths = np.array(self._sample())
            counts = np.bincount(lengths, minlength=int(lengths.max()) + 2)
            self._longer = len(lengths) - np.cumsum(counts)
        return self._longer
