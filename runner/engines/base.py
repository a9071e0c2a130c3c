"""The one seam between the runner and a generation backend.

An Engine takes Requests and gives back a Completion for each, in the order they finish. Two ways
in: `generate(requests)` pulls from an iterable as the engine has room; `submit` and `poll` push
work and collect what finished (a replica fed over the network does this). A request the backend
rejects becomes a Completion with `error` set, never an exception that stops the batch. Counters
are cumulative since the engine started; callers take differences.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Iterable, Iterator, Optional


@dataclass
class Request:
    row_id: str
    group_key: str
    prompt_token_ids: list[int]
    max_tokens: int
    cacheable_tokens: int = 0  # leading tokens a warm prefix cache holds for it (see plan.PrefixCacheBound)
    attempt: int = 1  # 2 for a retry (sampling.retry_max_tokens, retry_repetition_penalty)
    # Leading tokens every row of its group starts with (chat template head and system prompt):
    # held in the KV cache once for the group, computed by whichever of its rows runs first (that
    # row's cacheable_tokens is 0, yet these blocks are not its own).
    shared_tokens: int = 0
    document_tokens_cut: int = 0  # input.on_too_long: truncate: tokens cut from the document to fit


@dataclass
class Completion:
    row_id: str
    text: str = ""
    finish_reason: Optional[str] = None  # "stop", "length", or None when the request failed
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    latency_ms: float = 0.0
    preemptions: int = 0
    error: Optional[str] = None
    token_ids: list[int] = field(default_factory=list)  # what the model generated (empty: not known)


@dataclass
class EngineCounters:
    """Cumulative engine counters (vLLM's metric names in comments)."""

    prompt_tokens: int = 0  # vllm:prompt_tokens
    generation_tokens: int = 0  # vllm:generation_tokens
    prefix_cache_queries: int = 0  # vllm:prefix_cache_queries
    prefix_cache_hits: int = 0  # vllm:prefix_cache_hits
    spec_drafts: int = 0  # vllm:spec_decode_num_drafts
    spec_draft_tokens: int = 0  # vllm:spec_decode_num_draft_tokens
    spec_accepted_tokens: int = 0  # vllm:spec_decode_num_accepted_tokens
    preemptions: int = 0  # vllm:num_preemptions
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # vllm:spec_decode_num_accepted_tokens_per_pos

    def _combine(self, other: "EngineCounters", sign: int) -> "EngineCounters":
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, list):
                n = max(len(a), len(b))
                a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
                out[f.name] = [x + sign * y for x, y in zip(a, b)]
            else:
                out[f.name] = a + sign * b
        return EngineCounters(**out)

    def __sub__(self, other: "EngineCounters") -> "EngineCounters":
        return self._combine(other, -1)

    def __add__(self, other: "EngineCounters") -> "EngineCounters":
        return self._combine(other, 1)


@dataclass
class EngineInfo:
    """What the engine actually runs with, stored in the run's stats."""

    backend: str
    version: str
    settings: dict = field(default_factory=dict)
    kv_total_blocks: Optional[int] = None  # the KV cache the engine got (None: unknown)


class Engine(ABC):
    """A generation backend. Subclasses implement submit, poll, capacity, idle and counters; the
    rest has defaults. Use as a context manager, or call close()."""

    info: EngineInfo

    @abstractmethod
    def submit(self, requests: list[Request]) -> None:
        """Queue requests; they run as the engine has room."""

    @abstractmethod
    def poll(self) -> list[Completion]:
        """Make progress (one engine step) and return what finished; [] when idle."""

    @abstractmethod
    def capacity(self) -> int:
        """How many more requests the engine wants queued now (0: enough to keep it busy)."""

    @abstractmethod
    def idle(self) -> bool:
        """Nothing queued and nothing running."""

    @abstractmethod
    def counters(self) -> EngineCounters:
        """Cumulative counters since the engine started."""

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        """Run requests, pulling from the iterable as capacity frees up; yield each as it finishes."""
        source = iter(requests)
        exhausted = False
        while True:
            want = 0 if exhausted else self.capacity()
            if want:
                batch = list(itertools.islice(source, want))
                exhausted = len(batch) < want
                if batch:
                    self.submit(batch)
            yield from self.poll()
            if exhausted and self.idle():
                return

    def warmup(self, req: Request) -> None:
        """Run one throwaway request so that one-time costs stay out of a measurement (default: none)."""

    def expected_batch(self, req: Request) -> Optional[int]:
        """How many requests like `req` the engine would run at once (None: unknown)."""
        return None

    def adaptation(self) -> dict:
        """What the engine adapted while running, stored with the run's stats."""
        return {}

    def output_lengths(self) -> list[int]:
        """Output lengths of the rows it finished, as its admission planned with them (default: none
        kept): a calibration slice's are stored for later runs to start from."""
        return []

    def seed_output_lengths(self, lengths: list[int]) -> int:
        """Pace admission with these lengths (a stored calibration slice's) until enough of this
        engine's own rows are done; returns how many it took (default: 0, no admission to pace)."""
        return 0

    def close(self) -> None:
        """Release the engine (default: nothing to release)."""

    def let_go(self) -> None:
        """The process ends right after this (a completed `runner run`): release what would outlive
        it without waiting for the rest (default: close)."""
        self.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
