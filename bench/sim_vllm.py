"""A small model of vLLM's V1 scheduler for bench/admission_sim.py: FCFS admission while blocks
are free, a token budget per step, prefix blocks shared once computed, preemption of the newest
running request when a decode finds no free block, recompute of its tokens. Simpler than vLLM (no
chunked prefill, no cache hits on recompute of a preempted request's freed blocks)."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

BT = 16  # tokens a KV block holds


@dataclass
class SimReq:
    rid: str
    group: str
    prompt: int
    out_len: int
    hit: int = 0  # prefix tokens served from the cache
    made: int = 0  # output tokens so far
    owns_prefix: bool = False
    prefilled: bool = False
    preemptions: int = 0


@dataclass
class Vllm:
    blocks: int
    prefix_tokens: int
    max_num_seqs: int = 256
    token_budget: int = 16384
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    cached: dict = field(default_factory=dict)  # group -> requests holding its prefix (0: evictable)
    lru: list = field(default_factory=list)  # evictable prefixes, oldest first
    preemptions: int = 0
    prefill_tokens: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0

    @property
    def pblocks(self) -> int:
        return self.prefix_tokens // BT

    def private(self, r: SimReq) -> int:
        return math.ceil((r.prompt + r.made) / BT) - (self.pblocks if r.hit or r.owns_prefix else 0)

    def used(self) -> int:
        held = sum(1 for n in self.cached.values() if n > 0) * self.pblocks
        return held + sum(self.private(r) for r in self.running if r.prefilled or r.hit)

    def free(self) -> int:
        return self.blocks - self.used() - len(self.lru) * self.pblocks

    def _evict_until(self, need: int) -> bool:
        while self.free() < need and self.lru:
            g = self.lru.pop(0)
            del self.cached[g]
        return self.free() >= need

    def _release(self, r: SimReq) -> None:
        if r.hit or r.owns_prefix:
            self.cached[r.group] -= 1
            if self.cached[r.group] == 0:
                self.lru.append(r.group)

    def step(self) -> tuple[list[SimReq], int, int]:
        """One engine step: decodes, then admissions. Returns finished, prefill tokens, context tokens."""
        budget, ctx = self.token_budget, 0
        for r in list(self.running):  # decodes, oldest first; the newest is preempted on a shortage
            if r not in self.running:
                continue
            if (r.prompt + r.made) % BT == 0 and not self._evict_until(1):
                while self.running and not self._evict_until(1):
                    victim = self.running.pop()
                    self._release(victim)
                    victim.hit, victim.owns_prefix, victim.prefilled = 0, False, False  # recomputed, not regenerated
                    victim.preemptions += 1
                    self.preemptions += 1
                    self.waiting.appendleft(victim)
                    if victim is r:
                        break
                if r not in self.running:
                    continue
            r.made += 1
            budget -= 1
            ctx += r.prompt + r.made
        computed_now: set[str] = set()
        prefill = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            hit = r.group in self.cached and r.group not in computed_now
            need_tokens = r.prompt + r.made - (self.prefix_tokens if hit else 0)
            if need_tokens > budget:
                break
            need_blocks = math.ceil((r.prompt + r.made) / BT) - (self.pblocks if hit else 0)
            if hit and self.cached[r.group] == 0:
                self.lru.remove(r.group)
                self.cached[r.group] = 0
            if not self._evict_until(need_blocks + (0 if hit or r.group in self.cached else 0)):
                if hit and self.cached[r.group] == 0:
                    self.lru.append(r.group)
                break
            self.waiting.popleft()
            self.query_tokens += r.prompt
            if hit:
                r.hit = self.prefix_tokens
                self.cached[r.group] += 1
                self.hit_tokens += self.prefix_tokens
            elif r.group not in self.cached:
                r.owns_prefix = True
                self.cached[r.group] = 1
                computed_now.add(r.group)
            budget -= need_tokens
            prefill += need_tokens
            r.prefilled = True
            r.made += 1  # the prefill step samples a token
            self.running.append(r)
        self.prefill_tokens += prefill
        done = [r for r in self.running if r.made >= r.out_len]
        for r in done:
            self.running.remove(r)
            self._release(r)
        return done, prefill, ctx
