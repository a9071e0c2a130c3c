"""KV-cache admission control: never queue more work than the KV cache can hold.

vLLM admits a waiting request whenever its prompt fits in the free blocks and preempts (and
recomputes) one when decoding runs out: under a tight cache that eats the throughput. The runner
admits a request only while the blocks admitted requests will need (unshared prompt plus output)
fit, and shrinks that budget whenever vLLM still reports a preemption.

Two tests, cheap first: the sum of every request's peak fits (always, with a roomy cache); else the
projected peak fits (vLLM's own usage corrects the count where it runs high: kv_feedback.py).
Requests admitted earlier finish earlier: the projection walks forward one output token a step
(speculation turns it off), each request's length drawn from the recent finished outputs given how
far it ran, in whole blocks as vLLM allocates them; the expected blocks plus two standard deviations
of their sum must fit (a 90th percentile per request made every one plan for max_tokens where a few rows loop:
bench/results/2026-11-30-cpu-2core-admission-sim-sum.json). Rows of one group run about as long as
each other: their deviations correlate at 0.1 (fully: 10-18% more steps in the simulator where
lengths were independent; 0.1 cost ~1% there and cut preemptions by 40-60% where whole groups ran
to max_tokens: bench/results/2026-11-30-cpu-2core-admission-sim-review.json).

A preemption shrinks the budget by 15%, down to 70% of the cache; it grows back by 1% every 16
steps without one (a budget that only shrank ran up to 9x slower than plain vLLM in the simulator).

Pacing: requests admitted together finish together when their outputs are about as long (bounded
fields; a model that always runs to max_tokens) and hold their peaks at once: the projection would
admit convoys sized by peaks. Where the cache binds (it cannot hold max_num_seqs requests at their
peaks), admissions go at the rate that keeps it full in a steady state, room / (mean blocks a
request holds) / (mean output length) a step, from a bucket that holds at most one admission while
the fit tests refuse (else those saved up while a wave held the cache would go in as the next wave).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import count
from typing import Optional

import numpy as np

from runner.engines.base import Request
from runner.engines.kv_feedback import UsageFeedback
from runner.engines.output_lengths import OutputLengths

MARGIN_SD = 2.0  # the projection's margin, in standard deviations of the blocks held (see above)
GROUP_CORRELATION = 0.1  # between the length deviations of rows of one group (see above)
GRID_POINTS = 64  # steps ahead at which the projection is evaluated (each bounds its stretch)
SHRINK = 0.85  # the budget after a preemption, as a share of what it was
FLOOR = 0.7  # ... and never below this share of the cache
REGROW_STEPS = 16  # steps without a preemption after which the budget grows by 1% of the cache


@dataclass
class Ticket:
    """One admitted request."""

    unshared_tokens: int
    max_tokens: int
    blocks: int  # its peak, as admitted
    group: str
    step: Optional[int] = None  # engine step it was sent at (None: admitted, not sent yet)


class KvBudget:
    def __init__(self, total_blocks: Optional[int], block_tokens: int, min_output_samples: int = 16,
                 max_running: Optional[int] = None, project: bool = True, pace: bool = True,
                 shared_prefixes: bool = True, usage_feedback: bool = False):
        self.total_blocks = total_blocks  # blocks vLLM can allocate: its pool less its null block
        # vLLM's own usage checks the count (kv_feedback.py); the count is kept only with the projection
        self.feedback = UsageFeedback(total_blocks or 0, usage_feedback and project and total_blocks is not None)
        self.block_tokens = block_tokens
        self.budget = total_blocks  # None: unbounded (the cache size is not known)
        self.used = 0  # sum of the admitted requests' peaks
        self.max_running = max_running  # vLLM runs at most this many (max_num_seqs); the rest wait
        self.project = project
        self.pace = pace and project  # both count one token a step
        self.shared_prefixes = shared_prefixes  # False: vLLM caches no prefix; every row holds its own
        self._bucket: Optional[float] = None  # admissions the pace allows now (None: not started)
        self._bucket_step = 0
        self.pace_waits = 0  # polls in which the next request waited for the pace (also in `deferred`)
        self.step = 0
        self.tickets: dict[int, Ticket] = {}
        self._ids = count()
        self.lengths = OutputLengths(min_output_samples)  # of the finished cohort
        # Groups with requests in flight -> [requests, prefix blocks]: each such group's shared
        # prefix is held in the cache (and cannot be evicted) until its last request finishes.
        self._groups: dict[str, list[int]] = {}
        self._held_prefix = 0
        self.preemptions_seen = 0
        self._shrunk_at = 0  # step of the last preemption or regrowth
        self.deferred = 0  # times a request waited for blocks
        self.admitted_over_peaks = 0  # requests only the projection let in
        self.max_admitted = 0

    def output_estimate(self, max_tokens: int) -> int:
        """Output tokens to plan for: max_tokens until enough rows finished, then the 90th percentile
        of the finished cohort (+8)."""
        if not self.lengths.known():
            return max_tokens
        return min(max_tokens, self.lengths.spread().p90 + 8)

    def _running(self, i: int, t: Ticket) -> bool:
        """Ticket number i of those in flight runs in vLLM: sent, and within max_num_seqs (beyond it
        a sent request waits in vLLM's queue, holding no blocks and making no tokens)."""
        return t.step is not None and (self.max_running is None or i < self.max_running)

    def prefix_blocks(self, req: Request) -> int:
        """Blocks of the request's prompt that its group holds once: the head all its rows share, or
        more where the cache serves more. The group's first row computes the head for the rest:
        counted as its own too, the head was counted twice while that row ran."""
        if not self.shared_prefixes:
            return 0
        shared = min(max(req.cacheable_tokens, req.shared_tokens), len(req.prompt_token_ids) - 1)
        return shared // self.block_tokens  # vLLM computes the last prompt token whatever it caches

    def unshared(self, req: Request) -> int:
        """Prompt tokens the request holds blocks for on its own."""
        return len(req.prompt_token_ids) - self.prefix_blocks(req) * self.block_tokens

    def need(self, req: Request) -> int:
        """Blocks this request may occupy at its peak beyond its group's shared prefix."""
        return math.ceil((self.unshared(req) + self.output_estimate(req.max_tokens)) / self.block_tokens) + 1

    def capacity(self, req: Request) -> Optional[int]:
        """How many requests like `req` the cache holds at their peaks at once, with two groups'
        prefixes held (one ending, the next starting). None: unknown."""
        if self.budget is None:
            return None
        free = self.budget - 2 * self.prefix_blocks(req)
        return max(free // self.need(req), 1)

    def _reserve(self, req: Optional[Request] = None) -> int:
        """Blocks held by shared prefixes: every group in flight, plus `req`'s if its group is new."""
        extra = 0
        if req is not None:
            prefix = self.prefix_blocks(req)
            entry = self._groups.get(req.group_key)
            extra = prefix if entry is None else max(prefix - entry[1], 0)
        return self._held_prefix + extra

    def reserved_blocks(self) -> int:
        """Blocks held by the shared prefixes of the groups with requests in flight."""
        return self._reserve()

    def can_admit(self, req: Request) -> bool:
        if self.budget is None or not self.tickets:
            return True  # an empty engine always takes one request, whatever its size
        room = self.budget - self._reserve(req) + self.feedback.blocks
        if self.pace and not self._pace_allows(req, room):
            self.pace_waits += 1
            return False
        if self.used + self.need(req) <= room:
            return True
        if self.project and self.projected_peak(req) <= room:
            self.admitted_over_peaks += 1
            return True
        if self._bucket is not None:
            # Paced admissions refused for room must not pile up in the bucket: spent all at once
            # when a wave finishes, they would start the next convoy (8B shape, simulated: 3% more steps).
            self._bucket = min(self._bucket, 1.0)
        return False

    def _pace_allows(self, req: Request, room: int) -> bool:
        """True when the pace has an admission left now. Where it does not apply (the cache does
        not bind, outputs vary, or there is no room at all: the fit tests refuse then), the bucket
        is dropped, so that admissions made without the pace leave no debt."""
        if (self.max_running is None or room <= 0 or room >= self.max_running * self.need(req)
                or not self.uniform_outputs()):
            self._bucket = None
            return True
        length = max(self.mean_output(req.max_tokens), 1.0)
        steady = room / ((self.unshared(req) + length / 2) / self.block_tokens + 1)
        burst = max(4.0, steady / 8)
        if self._bucket is None:
            self._bucket, self._bucket_step = burst, self.step
        self._bucket = min(self._bucket + (self.step - self._bucket_step) * steady / length, burst)
        self._bucket_step = self.step
        return self._bucket >= 1

    def pacing(self) -> bool:  # the pace spreads admissions out now (see _pace_allows)
        return self._bucket is not None

    def uniform_outputs(self) -> bool:
        """Recent outputs about as long as each other (10th percentile >= 3/4 of the 90th): the
        case in which admitted waves stay together. Unknown until enough rows finished, unless a
        stored calibration's lengths seed the pace (output_lengths.py)."""
        spread = self.lengths.pace_spread()
        return spread is not None and spread.p10 >= 0.75 * spread.p90

    def mean_output(self, max_tokens: int) -> float:
        """Mean output tokens of the recent finished cohort (the same window as the percentiles:
        lengths change from one group of rows to the next), or of the seeds until then; else max_tokens."""
        spread = self.lengths.pace_spread()
        return max_tokens if spread is None else spread.mean

    def projected_peak(self, req: Request) -> float:
        """Peak blocks the running requests plus `req` are expected to hold over the coming steps,
        with a margin of MARGIN_SD standard deviations of that sum (one token a step). Rows of one
        group tend to run about as long as each other: their deviations partly add up
        (GROUP_CORRELATION); across groups they are independent."""
        ages, tokens, caps, groups = [], [], [], []
        for i, t in enumerate(self.tickets.values()):
            age = self.step - t.step if self._running(i, t) else 0
            ages.append(age)
            tokens.append(t.unshared_tokens + min(age, t.max_tokens))
            caps.append(t.max_tokens)
            groups.append(t.group)
        ages.append(0)
        tokens.append(self.unshared(req))
        caps.append(req.max_tokens)
        groups.append(req.group_key)
        age = np.array(ages)
        cap = np.maximum(np.array(caps), age + 1)  # one the clock counts past max_tokens is not done yet
        ends = self.lengths.support_end(age, cap)
        horizon = max(int((ends - age).max()), 1)
        stride = max(1, min(horizon // GRID_POINTS, self.block_tokens))
        xs = np.arange(0, horizon, stride)
        alive = self.lengths.survival(age, cap, xs)  # [request, x]: P(still running x steps ahead)
        # Its whole blocks at the stride's last step, the slot that step writes included (tokens /
        # block + 1 counted a block too many half the time: the simulated 8B took 1.8% more steps).
        blocks = np.ceil((np.array(tokens)[:, None] + xs[None, :] + stride) / self.block_tokens)
        mean = (alive * blocks).sum(axis=0)
        dev = np.sqrt(alive * (1 - alive)) * blocks
        _, group_of = np.unique(np.array(groups), return_inverse=True)
        by_group = np.zeros((group_of.max() + 1, len(xs)))
        np.add.at(by_group, group_of, dev)
        rho = GROUP_CORRELATION
        sd = np.sqrt((1 - rho) * (dev ** 2).sum(axis=0) + rho * (by_group ** 2).sum(axis=0))
        return float((mean + MARGIN_SD * sd).max())

    def admit(self, req: Request) -> int:
        blocks = self.need(req)
        ticket = next(self._ids)
        self.tickets[ticket] = Ticket(self.unshared(req), req.max_tokens, blocks, req.group_key)
        prefix = self.prefix_blocks(req)
        entry = self._groups.setdefault(req.group_key, [0, 0])
        entry[0] += 1
        if prefix > entry[1]:
            self._held_prefix += prefix - entry[1]
            entry[1] = prefix
        self.used += blocks
        if self._bucket is not None:  # the pace applies: this admission used it
            self._bucket -= 1
        self.max_admitted = max(self.max_admitted, len(self.tickets))
        return ticket

    def release(self, ticket: int, completion_tokens: Optional[int]) -> None:
        t = self.tickets.pop(ticket)
        self.used -= t.blocks
        entry = self._groups[t.group]
        entry[0] -= 1
        if entry[0] == 0:
            self._held_prefix -= entry[1]
            del self._groups[t.group]
        self.lengths.finished(ticket, completion_tokens)

    def submitted(self, ticket: int) -> None:
        """The request went to the engine now (a group's followers wait for their leader first)."""
        self.tickets[ticket].step = self.step

    def blocks_held(self) -> int:
        """Blocks the sent requests hold now by this budget's count (their unshared prompt and the
        tokens made so far, one a step), plus the prefixes of their groups: to set beside vLLM's usage."""
        held = 0
        for i, t in enumerate(self.tickets.values()):
            if self._running(i, t):
                made = min(self.step - t.step, t.max_tokens)
                held += math.ceil((t.unshared_tokens + made) / self.block_tokens)
        return held + self._held_prefix

    def observe_usage(self, usage: float, waiting: int = 0, held: Optional[int] = None) -> None:
        """vLLM's KV-cache usage (0-1) and queue now, beside this budget's count (`held`, if counted
        already): no sample while requests wait in the queue (they hold no blocks yet; kv_feedback.py)."""
        if self.project and self.total_blocks and waiting == 0:
            self.feedback.observe(self.blocks_held() if held is None else held, usage)

    def tick(self) -> None:
        """The engine made one step; REGROW_STEPS without a preemption give back 1% of the cache."""
        self.step += 1
        if (self.budget is not None and self.budget < self.total_blocks
                and self.step - self._shrunk_at >= REGROW_STEPS):
            self.budget = min(self.budget + max(self.total_blocks // 100, 1), self.total_blocks)
            self._shrunk_at = self.step

    def on_preemption(self) -> None:
        """vLLM preempted a request: what is admitted now was too much; admit less for a while."""
        self.preemptions_seen += 1
        self.feedback.preempted()
        if self.budget is not None:
            floor = max(int(FLOOR * self.total_blocks), self._reserve() + 1)
            self.budget = max(int(SHRINK * self.budget), min(floor, self.budget))
            self._shrunk_at = self.step

    def describe(self) -> dict:
        spread = self.lengths.spread()  # the recent cohort's: what the projection draws lengths from
        return {"kv_total_blocks": self.total_blocks, "kv_budget_blocks": self.budget, "kv_block_tokens": self.block_tokens,
                "output_tokens_estimate": (self.lengths.total / self.lengths.count) if self.lengths.count else None,
                "output_tokens_p10_p50_p90": list(spread[:3]) if spread else None,
                "preemptions_seen": self.preemptions_seen, "admissions_deferred": self.deferred,
                "admitted_by_projection": self.admitted_over_peaks, "pace_waits": self.pace_waits,
                "max_admitted": self.max_admitted,
                "output_lengths_seeded": self.lengths.seeds_given} | self.feedback.describe()
