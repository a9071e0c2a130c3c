"""KV-cache admission control: never queue more work than the KV cache can hold.

vLLM admits a waiting request whenever its prompt fits in the free blocks; when decoding later
runs out of blocks it preempts a running request and recomputes it from scratch. Under a tight
KV cache that recomputation eats the throughput. The runner therefore admits a request only while
the blocks that all admitted requests may need (their unshared prompt plus an output estimate)
fit in the cache, and shrinks that budget whenever vLLM still reports a preemption.
"""
from __future__ import annotations

import math
from typing import Optional

from runner.engines.base import Request


class KvBudget:
    def __init__(self, total_blocks: Optional[int], block_tokens: int, min_output_samples: int = 16):
        self.total_blocks = total_blocks
        self.block_tokens = block_tokens
        self.budget = total_blocks  # None: unbounded (the cache size is not known)
        self.used = 0
        self.min_output_samples = min_output_samples
        self._out_sum = 0
        self._out_n = 0
        self._max_prefix_blocks = 0
        self.preemptions_seen = 0
        self.deferred = 0  # times a request waited for blocks

    def output_estimate(self, max_tokens: int) -> int:
        """Output tokens to reserve: max_tokens until enough rows finished, then a margin over the mean."""
        if self._out_n < self.min_output_samples:
            return max_tokens
        return min(max_tokens, int(1.3 * self._out_sum / self._out_n) + 8)

    def need(self, req: Request) -> int:
        """Blocks this request may occupy beyond the shared prefix it can find in the cache."""
        unshared = len(req.prompt_token_ids) - req.cacheable_tokens
        return math.ceil((unshared + self.output_estimate(req.max_tokens)) / self.block_tokens) + 1

    def _reserve(self) -> int:
        # Shared prefixes of the (at most two) groups that overlap while one ends and the next starts.
        return 2 * self._max_prefix_blocks

    def can_admit(self, blocks: int) -> bool:
        if self.budget is None or self.used == 0:
            return True  # an empty engine always takes one request, whatever its size
        return self.used + blocks + self._reserve() <= self.budget

    def admit(self, req: Request, blocks: int) -> None:
        self.used += blocks
        self._max_prefix_blocks = max(self._max_prefix_blocks, req.cacheable_tokens // self.block_tokens)

    def release(self, blocks: int, completion_tokens: Optional[int]) -> None:
        self.used -= blocks
        if completion_tokens is not None:
            self._out_sum += completion_tokens
            self._out_n += 1

    def on_preemption(self) -> None:
        """vLLM preempted a request: what is admitted now was too much; admit less from here on."""
        self.preemptions_seen += 1
        if self.budget is not None:
            self.budget = max(int(0.85 * min(self.budget, self.used + self._reserve())), self._reserve() + 1)

    def describe(self) -> dict:
        return {
            "kv_total_blocks": self.total_blocks,
            "kv_budget_blocks": self.budget,
            "kv_block_tokens": self.block_tokens,
            "output_tokens_estimate": (self._out_sum / self._out_n) if self._out_n else None,
            "preemptions_seen": self.preemptions_seen,
            "admissions_deferred": self.deferred,
        }
