"""The KV budget's count of blocks held, checked against vLLM's own KV-cache usage.

The budget (admission.py) counts the blocks that requests in flight hold: their unshared prompt,
one output token a step since each was sent, and each group's shared prefix once. Where that count
runs above what vLLM reports, the runner admits fewer requests than the cache holds. On the H200
(commit acfb79a, 135M, 1,024 blocks, ~40 requests in flight, 7 runs) the count averaged 80.7-87.0%
of the cache against vLLM's 77.5-84.5%, 26-59 blocks more (means over whole runs, ramp-up and
drain included); on the 8B shape (15ad0d1, 3,072 blocks, 101 in flight) 81-84% against 80-83%.
Why is not known. With the feedback on, vLLM's usage is taken as the truth: the smallest excess of
the last few samples (one a second, taken only while nothing waits in vLLM's queue: requests it
queues hold no blocks yet, whatever the count assumes) is added to the room. Only an excess counts
(a count below vLLM's usage is what preemptions correct), at most MAX_SHARE of the cache; a
preemption while a correction is in force halves how large it may be again. Off by default: on
the H200 (commit d756c93, both models, 3 rounds) the correction ended at 5-10 blocks, the excess
coming and going within seconds, and requests in flight and engine steps were as without it.
"""
from __future__ import annotations

from collections import deque

SAMPLES = 8  # gap samples kept (one a second while requests run): the smallest counts
MIN_SAMPLES = 3  # before this many, no correction
MAX_SHARE = 0.25  # of the cache: the most the correction adds to the room


class UsageFeedback:
    """Blocks the budget may add to its room because its count runs above vLLM's usage."""

    def __init__(self, total_blocks: int, enabled: bool = True):
        self.total_blocks, self.enabled = total_blocks, enabled
        self.cap = int(MAX_SHARE * total_blocks)
        self.blocks = 0  # the correction in force
        self._gaps: deque[float] = deque(maxlen=SAMPLES)
        self.samples, self._gap_sum, self.max_blocks = 0, 0.0, 0

    def observe(self, counted_blocks: int, usage: float) -> None:
        """One sample: the budget's count now, and vLLM's usage (0-1) at the same step."""
        # vLLM's usage is 1 - free / (blocks - its null block): the blocks the budget counts
        gap = counted_blocks - usage * self.total_blocks
        self.samples += 1
        self._gap_sum += gap
        if not self.enabled:
            return
        self._gaps.append(gap)
        if len(self._gaps) >= MIN_SAMPLES:
            self.blocks = int(max(0.0, min(min(self._gaps), self.cap)))
            self.max_blocks = max(self.max_blocks, self.blocks)

    def preempted(self) -> None:
        """vLLM ran out of blocks. With a correction in force, the room it added was not there: start
        again, allowed half of it. Without one, the correction did not cause it: the cap stays."""
        if self.blocks > 0:
            self.cap = self.blocks // 2
        self.blocks = 0
        self._gaps.clear()

    def describe(self) -> dict:
        return {"kv_count_minus_usage_blocks": round(self._gap_sum / self.samples, 1) if self.samples else None,
                "kv_usage_correction_blocks": self.blocks, "kv_usage_correction_max_blocks": self.max_blocks}
