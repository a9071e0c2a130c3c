"""KV-cache admission control: never queue more work than the KV cache can hold.

vLLM admits a waiting request whenever its prompt fits in the free blocks; when decoding later
runs out of blocks it preempts a running request and recomputes it from scratch. Under a tight
KV cache that recomputation eats the throughput. The runner therefore admits a request only while
the blocks that admitted requests will need (their unshared prompt plus their output) fit in the
cache, and shrinks that budget whenever vLLM still reports a preemption.

Two tests, cheap first: the sum of every request's peak fits (always true with a roomy cache);
else the projected peak fits. Requests admitted earlier finish earlier, so the cache never holds
every request at its peak at once: the projection walks forward through the steps at which the
running requests finish, assuming one output token a step (speculation turns this off: it makes
more tokens a step) and outputs as long as the 90th percentile seen so far.

Pacing: requests admitted together finish together when their outputs are about as long (a
schema with bounded fields; a model that always runs to max_tokens), and then hold their peaks
at the same time, so the projection admits nothing until the whole wave is done: the cache holds
a convoy sized by peaks, never one sized by the average (a request is at its peak only at its
end). Where the cache binds (it cannot hold max_num_seqs requests at their peaks), admissions
are therefore spread out at the rate that keeps the cache full in a steady state: room /
(mean blocks a request holds) / (mean output length) per step, from a small bucket. The bucket
holds at most one admission while the fit tests refuse: otherwise the admissions saved up while a
wave held the cache would all go in when it finishes, as a new wave.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import count
from typing import NamedTuple, Optional

from runner.engines.base import Request


class Spread(NamedTuple):
    """Recent finished output lengths: percentiles (whole tokens) and mean."""

    p10: int
    p50: int
    p90: int
    mean: float


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
                 max_running: Optional[int] = None, project: bool = True, pace: bool = True):
        self.total_blocks = total_blocks
        self.block_tokens = block_tokens
        self.budget = total_blocks  # None: unbounded (the cache size is not known)
        self.used = 0  # sum of the admitted requests' peaks
        self.min_output_samples = min_output_samples
        self.max_running = max_running  # vLLM runs at most this many (max_num_seqs); the rest wait
        self.project = project
        self.pace = pace and project  # both count one token a step
        self._bucket: Optional[float] = None  # admissions the pace allows now (None: not started)
        self._bucket_step = 0
        self.pace_waits = 0  # polls in which the next request waited for the pace (also in `deferred`)
        self.step = 0
        self.tickets: dict[int, Ticket] = {}
        self._ids = count()
        self._out_sum = 0
        self._out_n = 0
        self._outputs: list[int] = []  # recent output lengths, for the percentile
        self._window: Optional[Spread] = None  # of _outputs, sorted once per change
        # Short outputs finish first, so the lengths seen so far under-sample long ones. Only a
        # cohort is a fair sample: lengths count once every request admitted before them is done.
        self._finished: dict[int, Optional[int]] = {}  # done, but an earlier ticket is still running
        self._cohort_end = 0  # every ticket below this one is done and counted
        # Groups with requests in flight -> [requests, prefix blocks]: each such group's shared
        # prefix is held in the cache (and cannot be evicted) until its last request finishes.
        self._groups: dict[str, list[int]] = {}
        self._held_prefix = 0
        self.preemptions_seen = 0
        self.deferred = 0  # times a request waited for blocks
        self.admitted_over_peaks = 0  # requests only the projection let in
        self.max_admitted = 0

    def output_estimate(self, max_tokens: int) -> int:
        """Output tokens to plan for: max_tokens until enough rows finished, then the 90th percentile
        of the finished cohort (+8)."""
        if self._out_n < self.min_output_samples:
            return max_tokens
        return min(max_tokens, self._recent().p90 + 8)

    def _recent(self) -> Spread:
        """Percentiles and mean of the recent output lengths, sorted once per change (admission
        asks for them on every request it considers). Needs at least one finished output."""
        if self._window is None:
            recent = sorted(self._outputs)
            at = [recent[int(q * (len(recent) - 1))] for q in (0.1, 0.5, 0.9)]
            self._window = Spread(*at, sum(recent) / len(recent))
        return self._window

    def _running(self, i: int, t: Ticket) -> bool:
        """Ticket number i of those in flight runs in vLLM: sent, and within max_num_seqs (beyond it
        a sent request waits in vLLM's queue, holding no blocks and making no tokens)."""
        return t.step is not None and (self.max_running is None or i < self.max_running)

    def need(self, req: Request) -> int:
        """Blocks this request may occupy at its peak beyond the shared prefix it finds in the cache."""
        unshared = len(req.prompt_token_ids) - req.cacheable_tokens
        return math.ceil((unshared + self.output_estimate(req.max_tokens)) / self.block_tokens) + 1

    def capacity(self, req: Request) -> Optional[int]:
        """How many requests like `req` the cache holds at their peaks at once, with two groups'
        prefixes held (one ending, the next starting). None: unknown."""
        if self.budget is None:
            return None
        free = self.budget - 2 * (req.cacheable_tokens // self.block_tokens)
        return max(free // self.need(req), 1)

    def _reserve(self, req: Optional[Request] = None) -> int:
        """Blocks held by shared prefixes: every group in flight, plus `req`'s if its group is new."""
        extra = 0
        if req is not None:
            prefix = req.cacheable_tokens // self.block_tokens
            entry = self._groups.get(req.group_key)
            extra = prefix if entry is None else max(prefix - entry[1], 0)
        return self._held_prefix + extra

    def reserved_blocks(self) -> int:
        """Blocks held by the shared prefixes of the groups with requests in flight."""
        return self._reserve()

    def can_admit(self, req: Request) -> bool:
        if self.budget is None or not self.tickets:
            return True  # an empty engine always takes one request, whatever its size
        room = self.budget - self._reserve(req)
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
        steady = room / ((len(req.prompt_token_ids) - req.cacheable_tokens + length / 2) / self.block_tokens + 1)
        burst = max(4.0, steady / 8)
        if self._bucket is None:
            self._bucket, self._bucket_step = burst, self.step
        self._bucket = min(self._bucket + (self.step - self._bucket_step) * steady / length, burst)
        self._bucket_step = self.step
        return self._bucket >= 1

    def uniform_outputs(self) -> bool:
        """Recent outputs about as long as each other (10th percentile >= 3/4 of the 90th): the
        case in which admitted waves stay together. Unknown until enough rows finished."""
        if self._out_n < self.min_output_samples:
            return False
        spread = self._recent()
        return spread.p10 >= 0.75 * spread.p90

    def mean_output(self, max_tokens: int) -> float:
        """Mean output tokens of the recent finished cohort (the same window as the percentiles:
        lengths change from one group of rows to the next); max_tokens until enough rows finished."""
        if self._out_n < self.min_output_samples:
            return max_tokens
        return self._recent().mean

    def projected_peak(self, req: Request) -> float:
        """Peak blocks the running requests plus `req` will hold, if each makes a token a step."""
        bt = self.block_tokens
        items = []  # (steps left, tokens now)
        for i, t in enumerate(self.tickets.values()):
            age = self.step - t.step if self._running(i, t) else 0
            length = self.output_estimate(t.max_tokens)
            if age >= length:  # longer than planned: it may run to max_tokens
                length = t.max_tokens
            items.append((max(length - age, 1), t.unshared_tokens + age))
        items.append((self.output_estimate(req.max_tokens), len(req.prompt_token_ids) - req.cacheable_tokens))
        items.sort()
        # Usage x steps ahead: sum over requests still running (steps left > x) of (tokens + x)/bt + 1.
        # It peaks just before a request finishes, so only x = 0 and x = left - 1 need checking.
        peak, tokens, alive = 0.0, sum(t for _, t in items), len(items)
        prev = None
        for left, now in items:
            if left != prev:
                x = left - 1
                peak = max(peak, (tokens + x * alive) / bt + alive)
                prev = left
            tokens -= now
            alive -= 1
        return peak

    def admit(self, req: Request) -> int:
        blocks = self.need(req)
        ticket = next(self._ids)
        self.tickets[ticket] = Ticket(len(req.prompt_token_ids) - req.cacheable_tokens, req.max_tokens, blocks,
                                      req.group_key)
        prefix = req.cacheable_tokens // self.block_tokens
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
        self._finished[ticket] = completion_tokens
        while self._cohort_end in self._finished:
            n = self._finished.pop(self._cohort_end)
            self._cohort_end += 1
            if n is not None:
                self._out_sum += n
                self._out_n += 1
                self._outputs.append(n)
                self._window = None
                if len(self._outputs) > 512:
                    del self._outputs[:256]

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

    def tick(self) -> None:
        """The engine made one step."""
        self.step += 1

    def on_preemption(self) -> None:
        """vLLM preempted a request: what is admitted now was too much; admit less from here on."""
        self.preemptions_seen += 1
        if self.budget is not None:
            self.budget = max(int(0.85 * self.budget), self._reserve() + 1)

    def describe(self) -> dict:
        return {
            "kv_total_blocks": self.total_blocks,
            "kv_budget_blocks": self.budget,
            "kv_block_tokens": self.block_tokens,
            "output_tokens_estimate": (self._out_sum / self._out_n) if self._out_n else None,
            # the recent cohort's spread: what the projection's 90th percentile stands for
            "output_tokens_p10_p50_p90": list(self._recent()[:3]) if self._outputs else None,
            "preemptions_seen": self.preemptions_seen,
            "admissions_deferred": self.deferred,
            "admitted_by_projection": self.admitted_over_peaks,
            "pace_waits": self.pace_waits,
            "max_admitted": self.max_admitted,
        }
