"""Planning: which rows run together and in what order, so that shared prefixes hit the cache.

Pure functions over Documents. Rows are grouped by a hash of their system prompt inside windows
of `window_rows` rows (memory stays bounded whatever the input size); inside a window, groups
run in order of first appearance and rows keep their input order, so a plan is deterministic.
"""
from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

from runner.prompting import Document, PromptBuilder, render_user
from runner.summary import one_line

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


def servable_tokens(prompt_tokens: int, block_tokens: int) -> int:
    """The most of a prompt vLLM's prefix cache can serve: its whole blocks, but never the block of
    its last token, which is always computed (PrefixCacheBound.add applies the same rule)."""
    return (prompt_tokens - 1) // block_tokens * block_tokens


class PrefixCacheBound:
    """Counts the prompt tokens an unbounded prefix cache could serve, the way vLLM matches them.

    vLLM hashes each full KV block together with everything before it and reuses a block whose
    chained hash it has seen; the last prompt token is always computed. Replaying the prompts in
    run order through the same rule gives the upper bound on the prefix-cache hit rate.
    """

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, max_blocks: int = 262_144):
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks  # memory cap: forgetting makes the bound a little lower, never higher
        self._seen: set[int] = set()
        self._generation = 0  # bumped when _seen is cleared
        self._heads: dict[str, tuple[int, int, int]] = {}  # key -> (tokens, chain hash, generation)

    def add(self, ids: list[int], head: Optional[tuple[str, int]] = None) -> int:
        """Record one prompt; return how many of its tokens the cache could have served.

        `head` (key, tokens) names a prefix every prompt with that key starts with (the chat
        template and system prompt). The head is remembered whole; past it, a prompt is remembered
        up to its first new block: a later prompt matches a block only if it matches every block
        before it, and past that point comes this row's own text. Once a head is remembered its
        blocks are not hashed again."""
        bs = self.block_tokens
        boundary = head[1] // bs * bs if head else 0
        h = hit = first = 0
        state = self._heads.get(head[0]) if head else None
        known = state is not None and state[2] == self._generation and state[0] <= len(ids) - 1
        if known:
            hit = first = state[0]
            h = state[1]
        for start in range(first, len(ids) - bs + 1, bs):
            if head and start == boundary and not known and hit == boundary:
                self._remember_head(head[0], start, h)
            h = hash((h, tuple(ids[start:start + bs])))
            if h in self._seen and start + bs <= len(ids) - 1 and hit == start:
                hit += bs  # still matching from the start
                continue
            self._seen.add(h)
            if hit and start >= boundary:
                break
        if len(self._seen) > self.max_blocks:
            self._seen.clear()
            self._heads.clear()
            self._generation += 1
        return hit

    def _remember_head(self, key: str, tokens: int, chain: int) -> None:
        if len(self._heads) > 4096:
            self._heads.clear()
        self._heads[key] = (tokens, chain, self._generation)


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
    rows_without_prompt: int = 0  # rows whose user template fails on their values
    rows_bad_input: int = 0  # rows with a null text or system prompt, or a system template they fail
    prompt_room: Optional[int] = None  # max_model_len - max_tokens: the longest prompt a row may have
    rows_too_long: int = 0  # rows whose prompt is longer (on_too_long: fail stores them failed)
    rows_uncuttable: int = 0  # of those, rows no cut of the document makes fit (counted with a `fits`)

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


class CharEstimate:
    """Prompt sizes without the model's tokenizer (a model not prepared yet): about four characters a
    token. What every prompt of a group shares: its system prompt, the few-shot turns and the user
    template's text before its first field."""

    CHARS_PER_TOKEN = 4
    MARKUP_TOKENS = 8  # the chat template's role markers, about

    def __init__(self, user_template: str = "{text}", examples: Iterable[dict] = ()):
        self.user_template = user_template
        self.examples_chars = sum(len(e.get("content") or "") for e in examples)
        self.user_head_chars = 0  # the literal text before the first field ("{{" is one literal "{")
        for literal, field_name, _, _ in string.Formatter().parse(user_template):
            self.user_head_chars += len(literal)
            if field_name is not None:
                break

    def user_text(self, doc: Document) -> str:
        return render_user(self.user_template, doc)

    def system_prefix_tokens(self, system: Optional[str]) -> int:
        return (len(system or "") + self.examples_chars + self.user_head_chars) // self.CHARS_PER_TOKEN

    def prompt_tokens(self, system: Optional[str], user: str) -> int:
        return (len(system or "") + self.examples_chars + len(user)) // self.CHARS_PER_TOKEN + self.MARKUP_TOKENS


def summarize_plan(docs: Iterable[Document], builder: Optional[PromptBuilder | CharEstimate],
                   block_tokens: int = DEFAULT_BLOCK_TOKENS, batch: int = 512,
                   prompt_room: Optional[int] = None, fits: Optional[Callable] = None) -> PlanSummary:
    """Count rows and prompt tokens per group over the whole input (one group record per prompt):
    with the model's tokenizer, or estimated (a CharEstimate, or None for one of the text alone);
    with prompt_room, the rows whose prompt is longer; with fits(system, doc, ids) (whether a cut
    of the document makes a row fit, as a run decides it), how many of those no cut saves."""
    builder = CharEstimate() if builder is None else builder
    summary = PlanSummary([], tokens_exact=not isinstance(builder, CharEstimate), block_tokens=block_tokens,
                          prompt_room=prompt_room)
    groups: dict[str, GroupSummary] = {}
    bound = PrefixCacheBound(block_tokens)
    pending: list[Document] = []
    for doc in docs:
        pending.append(doc)
        if len(pending) >= batch:
            _count(pending, builder, groups, bound, summary, fits)
            pending = []
    _count(pending, builder, groups, bound, summary, fits)
    summary.groups = [g for g in groups.values() if g.rows]  # not a group whose every row fails its template
    return summary


def _count(docs: list[Document], builder: PromptBuilder | CharEstimate, groups: dict[str, GroupSummary],
           bound: PrefixCacheBound, summary: "PlanSummary", fits: Optional[Callable] = None) -> None:
    """Tokenize a batch, a system prompt at a time (in parallel in the tokenizer), and count it."""
    by_prompt: dict[Optional[str], list[Document]] = {}
    for d in docs:
        if d.problem is not None:  # a null text or system prompt (input.on_bad_row: store): never run
            summary.rows_bad_input += 1
            continue
        by_prompt.setdefault(d.system_prompt, []).append(d)
    for system, rows in by_prompt.items():
        key = group_key(system)
        g = groups.get(key)
        if g is None:
            # escaped: a document's control characters (an OSC title, a `\r` overwrite) never reach the terminal
            preview = one_line((system or "(no system prompt)").strip(), limit=60)
            g = groups[key] = GroupSummary(key, preview, prefix_tokens=builder.system_prefix_tokens(system))
        if isinstance(builder, CharEstimate):
            _estimate(rows, system, g, builder, bound.block_tokens, summary)
            continue
        built, texts = [], []
        for d in rows:
            if summary.prompt_room is not None:  # a huge row: too long either way, counted as such
                d = builder.capped(d, max(summary.prompt_room, 1))
            try:
                texts.append(builder.user_text(d))
                built.append(d)
            except (KeyError, ValueError, TypeError, IndexError, AttributeError):
                summary.rows_without_prompt += 1  # a run stores such a row as failed
        for d, ids in zip(built, builder.prompt_ids_batch(system, texts)):
            g.rows += 1
            g.prompt_tokens += len(ids)
            if summary.prompt_room is not None and len(ids) > summary.prompt_room:
                summary.rows_too_long += 1
                summary.rows_uncuttable += fits is not None and not fits(system, d, ids)
            g.cacheable_tokens += bound.add(ids, head=(key, builder.head_tokens(system)))


def _estimate(rows: list[Document], system: Optional[str], g: GroupSummary, est: CharEstimate, block_tokens: int,
              summary: "PlanSummary") -> None:
    """Count a batch of one group without a tokenizer: every row after the group's first reuses the
    whole blocks of the shared prefix (as vLLM, never the block of a prompt's last token)."""
    shared = g.prefix_tokens // block_tokens * block_tokens
    for d in rows:
        try:
            n = est.prompt_tokens(system, est.user_text(d))
        except (KeyError, ValueError, TypeError, IndexError, AttributeError):
            summary.rows_without_prompt += 1  # a run stores such a row as failed
            continue
        if g.rows:
            g.cacheable_tokens += min(shared, servable_tokens(n, block_tokens))
        g.rows += 1
        g.prompt_tokens += n
        summary.rows_too_long += summary.prompt_room is not None and n > summary.prompt_room
