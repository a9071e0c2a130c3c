"""A deterministic stand-in engine for tests of the runner's own logic (never for generation).

It answers each request with `respond(request)` or, by default, a minimal instance of the job's
JSON schema, and imitates a block-granular prefix cache so that the runner's stats have numbers.
"""
from __future__ import annotations

import json
import time
from collections import deque
from typing import Callable, Optional

from runner.engines.base import Completion, Engine, EngineCounters, EngineInfo, Request
from runner.plan import DEFAULT_BLOCK_TOKENS as BLOCK_TOKENS


def example_for_schema(schema: dict, seed: str = "", root: Optional[dict] = None) -> object:
    """A small value that satisfies simple JSON Schemas (objects, arrays, enums, scalars, local $ref)."""
    root = schema if root is None else root
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target = root
        for part in ref[2:].split("/"):
            target = target[part]
        return example_for_schema(target, seed, root)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):  # (an empty one has no value: the schema check fails the row)
        return schema["enum"][len(seed) % len(schema["enum"])]
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties", {})
        return {k: example_for_schema(props.get(k, {}), seed, root) for k in schema.get("required", list(props))}
    if kind == "array":
        n = max(schema.get("minItems", 1), 1)
        return [example_for_schema(schema.get("items", {"type": "string"}), seed, root) for _ in range(n)]
    if kind == "integer":
        return int(schema.get("minimum", 1))
    if kind == "number":
        return float(schema.get("minimum", 0.5))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = f"fake {seed}".strip()
    return text[: schema.get("maxLength", len(text))].ljust(schema.get("minLength", 0), "x")


class FakeEngine(Engine):
    QUEUE = 64  # requests it takes at once, like a small engine
    PER_POLL = 8  # requests it finishes a step: rows come back a few at a time, as from vLLM

    def __init__(self, schema: dict, respond: Optional[Callable[[Request], str]] = None,
                 delay_s: float = 0.0, finish_reason: Callable[[Request], str] = lambda r: "stop",
                 block_tokens: int = BLOCK_TOKENS, record: bool = True, close_s: float = 0.0):
        self.schema = schema
        self.close_s = close_s  # a shutdown that takes this long (a stuck engine, for the stop tests)
        self.respond = respond or (lambda r: json.dumps(example_for_schema(schema, r.row_id)))
        self.delay_s = delay_s
        self.block_tokens = block_tokens
        self.finish_reason = finish_reason
        self._totals = EngineCounters()
        self._prefixes: dict[str, list[int]] = {}
        self._queue: deque[Request] = deque()
        self.record = record  # keep every request for tests to inspect (off for the CLI: memory)
        self.seen: list[Request] = []
        self.batch: Optional[int] = None
        self.warmed: list[str] = []
        self.lengths: list[int] = []  # completion tokens of the rows it answered
        self.seeded: list[int] = []  # lengths handed to it from a stored calibration
        self.info = EngineInfo(backend="fake", version="0", settings={"delay_s": delay_s})

    def _cached(self, req: Request) -> int:
        first = self._prefixes.setdefault(req.group_key, req.prompt_token_ids)
        ids = req.prompt_token_ids
        if first is ids:
            return 0
        lo, hi = 0, min(len(first), len(ids))  # the common prefix, by bisection on C-level slice compares
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if first[:mid] == ids[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return min(lo // self.block_tokens * self.block_tokens, len(ids) - 1)

    def submit(self, requests: list[Request]) -> None:
        self._queue.extend(requests)

    def capacity(self) -> int:
        return max(self.QUEUE - len(self._queue), 0)

    def idle(self) -> bool:
        return not self._queue

    def poll(self) -> list[Completion]:
        out = []
        while self._queue and len(out) < self.PER_POLL:
            out.append(self._answer(self._queue.popleft()))
        return out

    def _answer(self, req: Request) -> Completion:
        if self.record:
            self.seen.append(req)
        if self.delay_s:
            time.sleep(self.delay_s)
        text = self.respond(req)
        tokens = max(1, len(text) // 4)
        self.lengths.append(tokens)
        cached = self._cached(req)
        t = self._totals
        t.prompt_tokens += len(req.prompt_token_ids)
        t.generation_tokens += tokens
        t.prefix_cache_queries += len(req.prompt_token_ids)
        t.prefix_cache_hits += cached
        return Completion(row_id=req.row_id, text=text, finish_reason=self.finish_reason(req),
                          prompt_tokens=len(req.prompt_token_ids), completion_tokens=tokens,
                          cached_prompt_tokens=cached, latency_ms=self.delay_s * 1000)

    def counters(self) -> EngineCounters:
        return self._totals + EngineCounters()

    def output_lengths(self) -> list[int]:
        return self.lengths[-512:]

    def seed_output_lengths(self, lengths: list[int]) -> int:
        self.seeded = list(lengths)
        return len(self.seeded)

    def close(self) -> None:
        if self.close_s:
            time.sleep(self.close_s)

    def warmup(self, req: Request) -> None:
        self.warmed.append(req.row_id)  # like vLLM's: generates nothing that counts

    def expected_batch(self, req: Request) -> Optional[int]:
        return self.batch  # tests set it; None: unknown, like a backend that cannot tell
