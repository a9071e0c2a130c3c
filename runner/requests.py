"""Documents to engine Requests: prompts rendered and tokenized a chunk of a group at a time, read,
planned and built ahead of the engine in a thread (build_ahead).

A row whose prompt cannot be built (a value its format spec does not fit, a chat template that
refuses it, a prompt too long for the model) becomes a failed Completion here, never an exception.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable, Iterator, Optional

from runner.engines import Completion, Request
from runner.errors import ModelError, TemplateError
from runner.prefetch import prefetch
from runner.plan import Group, GroupSummary, PlanSummary, PrefixCacheBound, plan_stream, servable_tokens
from runner.prompting import Document, PromptBuilder
from runner.readers import make_reader
from runner.spec import Job

TOKENIZE_CHUNK_ROWS = 64  # rows tokenized together: parallel in the tokenizer, small enough to start fast
BUILT_AHEAD_CHUNKS = 32  # chunks of built requests waiting for the engine (2048 rows)


class RequestBuilder:
    """Planned groups -> chunks of Requests (or failed Completions), counting the prefix-cache bound."""

    def __init__(self, job: Job, builder: PromptBuilder):
        self.job, self.builder = job, builder
        self.max_tokens = job.spec.sampling.max_tokens
        self.max_model_len = job.engine.max_model_len
        self.truncate = job.spec.input.on_too_long == "truncate"
        self.groups: dict[str, GroupSummary] = {}  # what was planned, for the prefix-share bound
        self.build_s = self.read_s = 0.0  # tokenizing and reading (in the reading thread)
        self.bound = PrefixCacheBound(job.block_tokens)
        # retries (the driver's thread; the groups above are the reading thread's): their prompts again
        self.retried = GroupSummary("(retries)", "")

    def plan(self) -> PlanSummary:
        """What the run planned, its retries included: the bound of the hit rate it measures."""
        extra = [self.retried] if self.retried.prompt_tokens else []
        return PlanSummary(list(self.groups.values()) + extra, tokens_exact=True, block_tokens=self.job.block_tokens)

    def count_retry(self, request: Request) -> None:
        """A retry sends a prompt vLLM has seen: all of it that the cache can serve can be a hit."""
        n = len(request.prompt_token_ids)
        self.retried.prompt_tokens += n
        self.retried.cacheable_tokens += servable_tokens(n, self.job.block_tokens)

    def stream(self, groups: Iterable[Group]) -> Iterator[tuple[str, list[Request | Completion]]]:
        """(group key, built chunk) for every chunk of every planned group."""
        for group in groups:
            for start in range(0, len(group.docs), TOKENIZE_CHUNK_ROWS):
                t0 = time.perf_counter()
                built = self.build_many(group, group.docs[start:start + TOKENIZE_CHUNK_ROWS])
                self.build_s += time.perf_counter() - t0
                yield group.key, built

    def build_many(self, group: Group, docs: list[Document]) -> list[Request | Completion]:
        """A chunk of one group's rows, tokenized together (in parallel)."""
        b = self.builder
        out: list[Request | Completion | Document] = []
        texts: list[tuple[int, str]] = []
        whole, docs = docs, [d if d.problem else b.capped(d, self.max_model_len) for d in docs]
        for d in docs:
            if d.problem:
                out.append(Completion(d.row_id, error=d.problem))
                continue
            try:
                texts.append((len(out), b.user_text(d)))
                out.append(d)  # a placeholder, replaced below
            except (KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
                out.append(Completion(d.row_id, error=f"prompt could not be built from prompts.user_template: "
                                                       f"{exc.__class__.__name__}: {exc}"))
        try:
            all_ids = b.prompt_ids_batch(group.system_prompt, [t for _, t in texts])
        except (ModelError, TemplateError) as exc:  # the chat template refused this system prompt
            return [Completion(d.row_id, error=str(exc)) if isinstance(o, Document) else o for d, o in zip(docs, out)]
        for (i, _), ids in zip(texts, all_ids):
            out[i] = self._request(group, docs[i], ids, whole[i] if whole[i] is not docs[i] else None)
        return out

    def _request(self, group: Group, doc: Document, ids: list[int], original: Optional[Document] = None
                 ) -> Request | Completion:
        """original: the document before capped() cut it. Where its part overflows the prompt, what
        the whole would do is known (the same first tokens, too long); where it does not, the whole
        is tokenized after all (a normalizer may have dropped more than capped() allows for)."""
        b = self.builder
        ids, too_long, cut = b.fit(group.system_prompt, doc, ids, self.max_model_len, self.max_tokens, self.truncate)
        if original is not None and not too_long and not cut:
            doc = original
            ids = b.prompt_ids(group.system_prompt, b.user_text(doc))
            ids, too_long, cut = b.fit(group.system_prompt, doc, ids, self.max_model_len, self.max_tokens, self.truncate)
        elif original is not None and too_long and "set input.on_too_long: truncate" in too_long:
            too_long = (f"the document is {len(original.text):,} characters, more than max_model_len="
                        f"{self.max_model_len} tokens can hold (set input.on_too_long: truncate to cut it)")
        if too_long:
            return Completion(doc.row_id, prompt_tokens=len(ids), error=too_long)
        g = self.groups.setdefault(group.key, GroupSummary(group.key, ""))
        head = b.head_tokens(group.system_prompt)
        cacheable = self.bound.add(ids, head=(group.key, head))
        g.rows += 1
        g.prompt_tokens += len(ids)
        g.cacheable_tokens += cacheable
        return Request(doc.row_id, group.key, ids, self.max_tokens, cacheable, shared_tokens=min(head, len(ids) - 1),
                       document_tokens_cut=cut)


def build_ahead(job: Job, rb: RequestBuilder, is_done: Optional[Callable[[list[str]], set[str]]],
                skip: set[int] = frozenset()):
    """Read, skip done rows, plan and tokenize in a thread from now on, while the engine starts and
    then while it generates: the driver's own work stays off the engine's critical path (the
    tokenizer releases the GIL). At most BUILT_AHEAD_CHUNKS chunks wait, which bounds the token
    ids held; done rows are asked of the database a batch at a time."""
    documents = _timed(make_reader(job).documents(job.system_source, skip), rb)  # Ray starts here, not in the thread
    if is_done is not None:
        documents = _not_done(documents, is_done)
    return prefetch(rb.stream(plan_stream(documents, job.spec.plan_window_rows)), BUILT_AHEAD_CHUNKS)


def _timed(documents: Iterator[Document], rb: RequestBuilder) -> Iterator[Document]:
    """The documents, adding the time spent reading them to rb.read_s."""
    while True:
        t0 = time.perf_counter()
        doc = next(documents, None)
        rb.read_s += time.perf_counter() - t0
        if doc is None:
            return
        yield doc


def _not_done(documents: Iterator[Document], is_done: Callable[[list[str]], set[str]], batch: int = 2048
              ) -> Iterator[Document]:
    while True:
        chunk = list(itertools.islice(documents, batch))
        if not chunk:
            return
        done = is_done([d.row_id for d in chunk])
        yield from (d for d in chunk if d.row_id not in done)
