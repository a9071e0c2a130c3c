"""Planning: which rows run together and in what order, so that shared prefixes hit the cache.

Pure functions over Documents. Rows are grouped by a hash of their system prompt inside windows
of `window_rows` rows (memory stays bounded whatever the input size); inside a window, groups
run in order of first appearance and rows keep their input order, so a plan is deterministic.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

from runner.prompting import Document, PromptBuilder

DEFAULT_BLOCK_TOKENS = 16  # vLLM caches prefixes in whole KV blocks (16 tokens on GPU unless configured)


def group_key(system_prompt: Optional[str]) -> str:
    """A short stable key for a system prompt (`none` when a row has none)."""
    if not system_prompt:
        return "none"
    return hashlib.sha256(system_prompt.encode()).hexdigest()[:12]


@dataclass
class Group:
    key: str
    system_prompt: Optional[str]
    docs: list[Document] = field(default_factory=list)


def plan_window(docs: Iterable[Document], first_key: Optional[str] = None) -> list[Group]:
    """Group one window of rows. `first_key`, the group that ran last, goes first to reuse its cache."""
    groups: dict[str, Group] = {}
    for doc in docs:
        key = group_key(doc.system_prompt)
        if key not in groups:
            groups[key] = Group(key, doc.system_prompt)
        groups[key].docs.append(doc)
    ordered = list(groups.values())
    if first_key in groups:
        ordered.sort(key=lambda g: g.key != first_key)  # stable: the rest keep first-appearance order
    return ordered


def plan_stream(docs: Iterable[Document], window_rows: int, skip_ids: frozenset[str] | set[str] = frozenset()
                ) -> Iterator[Group]:
    """Planned groups over a stream of rows, leaving out rows already done."""
    window: list[Document] = []
    last: Optional[str] = None
    for doc in docs:
        if doc.row_id in skip_ids:
            continue
        window.append(doc)
        if len(window) >= window_rows:
            for g in plan_window(window, last):
                last = g.key
                yield g
            window = []
    if window:
        for g in plan_window(window, last):
            yield g


class PrefixCacheBound:
    """Counts the prompt tokens an unbounded prefix cache could serve, the way vLLM matches them.

    vLLM hashes each full KV block together with everything before it and reuses a block whose
    chained hash it has seen; the last prompt token is always computed. Replaying the prompts in
    run order through the same rule gives the upper bound on the prefix-cache hit rate.
    """

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, max_blocks: int = 4_000_000):
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks  # memory cap: forgetting makes the bound a little lower, never higher
        self._seen: set[int] = set()

    def add(self, ids: list[int]) -> int:
        """Record one prompt; return how many of its tokens the cache could have served."""
        bs = self.block_tokens
        h = 0
        hit, matching = 0, True
        for start in range(0, len(ids) - bs + 1, bs):
            h = hash((h, tuple(ids[start:start + bs])))
            if matching and h in self._seen and start + bs <= len(ids) - 1:
                hit += bs
            else:
                matching = False
                self._seen.add(h)
        if len(self._seen) > self.max_blocks:
            self._seen.clear()
        return hit


@dataclass
class GroupSummary:
    key: str
    preview: str
    rows: int = 0
    prompt_tokens: int = 0
    prefix_tokens: int = 0  # of the system prompt, shared by every row of the group
    cacheable_tokens: int = 0  # prompt tokens an unbounded prefix cache could serve


@dataclass
class PlanSummary:
    groups: list[GroupSummary]
    tokens_exact: bool  # False when counted without the model's tokenizer (chars / 4)
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def prompt_tokens(self) -> int:
        return sum(g.prompt_tokens for g in self.groups)

    @property
    def prefix_share(self) -> float:
        """Share of prompt tokens that are a cached shared prefix: the bound on the prefix-cache hit rate."""
        total = self.prompt_tokens
        return sum(g.cacheable_tokens for g in self.groups) / total if total else 0.0


def summarize_plan(docs: Iterable[Document], builder: Optional[PromptBuilder],
                   block_tokens: int = DEFAULT_BLOCK_TOKENS, batch: int = 256) -> PlanSummary:
    """Count rows and prompt tokens per group over the whole input (one group record per prompt)."""
    groups: dict[str, GroupSummary] = {}
    pending: list[Document] = []
    bound = PrefixCacheBound(block_tokens)

    def flush():
        if builder is not None:
            encoded = [builder.prompt_ids(d.system_prompt, builder.user_text(d)) for d in pending]
        else:  # no tokenizer: about four characters a token, and no cache estimate
            encoded = [[0] * ((len(d.system_prompt or "") + len(d.text)) // 4 + 8) for d in pending]
        for doc, ids in zip(pending, encoded):
            key = group_key(doc.system_prompt)
            g = groups.get(key)
            if g is None:
                preview = (doc.system_prompt or "(no system prompt)").strip().replace("\n", " ")[:60]
                prefix = builder.system_prefix_tokens(doc.system_prompt) if builder else len(doc.system_prompt or "") // 4
                g = groups[key] = GroupSummary(key, preview, prefix_tokens=prefix)
            g.rows += 1
            g.prompt_tokens += len(ids)
            if builder is not None:
                g.cacheable_tokens += bound.add(ids)
        pending.clear()

    for doc in docs:
        pending.append(doc)
        if len(pending) >= batch:
            flush()
    flush()
    return PlanSummary(list(groups.values()), tokens_exact=builder is not None, block_tokens=block_tokens)
