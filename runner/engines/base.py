"""The one seam between the runner and a generation backend.

An Engine takes a stream of Requests and yields a Completion for each, in the order they finish.
A request the backend rejects becomes a Completion with `error` set, never an exception that
stops the batch. Counters are cumulative since the engine started; callers take differences.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterable, Iterator, Optional, Protocol


@dataclass
class Request:
    row_id: str
    group_key: str
    prompt_token_ids: list[int]
    max_tokens: int
    cacheable_tokens: int = 0  # leading tokens a warm prefix cache holds for it (see plan.PrefixCacheBound)


PAUSE = Request("", "", [], 0)  # a source may yield this: "nothing to add now, keep stepping"


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


class Engine(Protocol):
    info: EngineInfo

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        """Run requests, pulling from the iterable as capacity frees up; yield each as it finishes."""
        ...

    def counters(self) -> EngineCounters:
        """Cumulative counters since the engine started."""
        ...

    def expected_batch(self, req: Request) -> Optional[int]:
        """How many requests like `req` the engine would run at once (None: unknown)."""
        ...

    def adaptation(self) -> dict:
        """What the engine adapted while running, stored with the run's stats."""
        ...

    def close(self) -> None:
        ...
