"""The run loop: job spec → plan (groups, order) → engine → checked results → store.

Rows already stored for the job are skipped (resume). Results are committed every
`output.commit_every_rows` rows in one transaction; a kill loses at most the batch in flight.
"""
from __future__ import annotations

import itertools
import json
import signal
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Optional, Protocol

from runner.calibrate import CalibrationContext, calibrate
from runner.engines import Completion, Engine, Request, build_engine
from runner.errors import ModelError, RunnerError
from runner.fingerprint import calibration_key, changed_parts, result_fingerprint
from runner.inputs import InputScan, iter_documents, prefetch, scan_input
from runner.lock import JobLock
from runner.outputs import FAILED, OK, STATUSES, OutputChecker
from runner.plan import Group, GroupSummary, PlanSummary, PrefixCacheBound, plan_stream
from runner.run_engines import RunEngines
from runner.prompting import Document, PromptBuilder
from runner.spec import Job
from runner.stats import build_stats
from runner.store import DoneFilter, Store


SAMPLE_EVERY_S = 2.0  # throughput samples for reports
TOKENIZE_CHUNK_ROWS = 64  # rows tokenized together: parallel in the tokenizer, small enough to start fast
BUILT_AHEAD_CHUNKS = 32  # chunks of built requests waiting for the engine (2048 rows)


class Progress(Protocol):
    def update(self, n: int = 1) -> object: ...


@dataclass
class RunSummary:
    run_id: int
    database: str
    rows_input: int
    rows_skipped: int
    counts: dict[str, int]  # this run's rows by status
    stats: dict
    rows_redone: int = 0  # stored rows run again: made by another version of the job, or --retry-failed
    redo_reasons: list[str] = field(default_factory=list)  # what changed, e.g. "sampling.max_tokens"
    job_counts: dict[str, int] = field(default_factory=dict)  # all the job's stored rows by status

    @property
    def failed_fraction(self) -> float:
        total = sum(self.job_counts.values())
        return (total - self.job_counts.get("ok", 0)) / total if total else 0.0


class Interrupted(RunnerError):
    """The run was stopped by SIGTERM or Ctrl-C; what finished is stored."""

    exit_code = 130


def _raise_interrupted(signum, _frame):
    raise Interrupted(f"stopped by signal {signal.Signals(signum).name}; finished rows are stored, rerun to resume")


class RequestBuilder:
    """Documents → engine Requests, with the prompt-length rule applied."""

    def __init__(self, job: Job, builder: PromptBuilder):
        self.job, self.builder = job, builder
        self.max_len = job.engine.max_model_len
        self.max_tokens = job.spec.sampling.max_tokens
        self.groups: dict[str, GroupSummary] = {}  # what was planned, for the prefix-share bound
        self.build_s = self.read_s = 0.0  # tokenizing and reading (in the reading thread)
        self.bound = PrefixCacheBound(job.block_tokens)

    def plan(self) -> PlanSummary:
        return PlanSummary(list(self.groups.values()), tokens_exact=True, block_tokens=self.job.block_tokens)

    def stream(self, groups: Iterable[Group]) -> Iterator[tuple[str, list[Request | Completion]]]:
        """(group key, built chunk) for every chunk of every planned group."""
        for group in groups:
            for start in range(0, len(group.docs), TOKENIZE_CHUNK_ROWS):
                t0 = time.perf_counter()
                built = self.build_many(group, group.docs[start:start + TOKENIZE_CHUNK_ROWS])
                self.build_s += time.perf_counter() - t0
                yield group.key, built

    def build_many(self, group: Group, docs: list[Document]) -> list[Request | Completion]:
        """build() for a chunk of one group's rows, tokenized together (in parallel). A row whose
        prompt cannot be built (a format spec its value does not fit) is a failed row, not a crash."""
        b = self.builder
        out: list[Request | Completion] = []
        texts: list[tuple[int, str]] = []
        for d in docs:
            try:
                texts.append((len(out), b.user_text(d)))
                out.append(d)  # placeholder, replaced below
            except (KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
                out.append(Completion(d.row_id, error=f"prompt could not be built from prompts.user_template: "
                                                       f"{exc.__class__.__name__}: {exc}"))
        try:
            all_ids = b.prompt_ids_batch(group.system_prompt, [t for _, t in texts])
        except ModelError as exc:  # the chat template refused this system prompt (raise_exception)
            return [Completion(d.row_id, error=str(exc)) if isinstance(o, Document) else o for d, o in zip(docs, out)]
        for (i, _), ids in zip(texts, all_ids):
            out[i] = self.build(group, docs[i], ids)
        return out

    def build(self, group: Group, doc: Document, ids: list[int]) -> Request | Completion:
        b = self.builder
        over = len(ids) + self.max_tokens - self.max_len
        if over > 0 and self.job.spec.input.on_too_long == "truncate":
            text_ids = b.encode(doc.text)
            cut = Document(doc.row_id, b.decode(text_ids[: max(len(text_ids) - over - 8, 0)]), doc.system_prompt, doc.fields)
            ids = b.prompt_ids(group.system_prompt, b.user_text(cut))
            over = len(ids) + self.max_tokens - self.max_len
        if over > 0:
            return Completion(doc.row_id, prompt_tokens=len(ids), error=(
                f"prompt is {len(ids)} tokens; with max_tokens={self.max_tokens} it exceeds "
                f"max_model_len={self.max_len} (set input.on_too_long: truncate to cut the document)"))
        g = self.groups.setdefault(group.key, GroupSummary(group.key, ""))
        cacheable = self.bound.add(ids, head=(group.key, b.head_tokens(group.system_prompt)))
        g.rows += 1
        g.prompt_tokens += len(ids)
        g.cacheable_tokens += cacheable
        return Request(doc.row_id, group.key, ids, self.max_tokens, cacheable)


@dataclass
class RunOptions:
    """How to run a job: the CLI's flags, and the seams tests use."""

    restart: bool = False  # delete the job's stored results first
    retry_failed: bool = False  # run the rows that are not ok (ok rows stay, whatever made them)
    recalibrate: bool = False  # measure `speculative: auto` again instead of reusing a stored choice
    wait: bool = False  # wait for a running instance of the job instead of failing
    log_path: Optional[str] = None  # where the engine's output goes (stored with the run)
    progress_factory: Optional[Callable[[int], Progress]] = None
    on_input_ok: Optional[Callable[[], None]] = None  # once input, model, lock and database are fine
    notify: Optional[Callable[[str], None]] = None  # told what the run will redo, before it starts
    clock: Callable[[], float] = time.perf_counter


@dataclass
class Work:
    """What a run will do, decided before it starts."""

    fingerprint: str  # of the job as it is now: stored with every row it makes
    todo: int  # input rows to run
    skipped: int  # input rows already done
    redone: int  # stored rows to run again (another version of the job, or --retry-failed)
    reasons: list[str]  # what changed, e.g. "sampling.max_tokens"
    is_done: DoneFilter  # which rows of a batch to skip, asked of the database


def run_job(job: Job, engine_factory: Callable[[Job], Engine] = build_engine, options: Optional[RunOptions] = None,
            **kw) -> RunSummary:
    """Run a job to completion (or resume it). Raises RunnerError subclasses; never prints.

    Rows stored by this version of the job are skipped; rows made by another version (a changed
    schema, prompt, sampling...) run again and the old results move to results_history. Options:
    RunOptions, or its fields as keywords."""
    opts = options or RunOptions(**kw)
    # Bad input or a missing model stops the run here, before anything is written.
    scan = scan_input(job.input_path, job.spec.input, keep_ids=True)
    try:
        builder = PromptBuilder(job.model_path, job.spec.prompts.user_template)
        with JobLock(job.database_path, job.name, wait=opts.wait):
            store = Store(job.database_path)
            try:
                return _run_locked(job, scan, builder, store, engine_factory, opts)
            finally:
                store.close()  # the last connection checkpoints the WAL into the database file
    finally:
        scan.ids.close()


def _run_locked(job: Job, scan: InputScan, builder: PromptBuilder, store: Store,
                engine_factory: Callable[[Job], Engine], opts: RunOptions) -> RunSummary:
    store.check_integrity()
    if opts.on_input_ok is not None:
        opts.on_input_ok()
    if opts.restart:
        store.delete_results(job.name)
    store.mark_abandoned_runs(job.name)
    work = _work(store, job, scan, opts.retry_failed)
    if work.redone and opts.notify is not None:
        opts.notify(f"running {work.redone:,} stored rows again: " + ("--retry-failed" if opts.retry_failed else
                    "they were made by another version of the job (changed: " + ", ".join(work.reasons) + ")"))
    run_id = store.begin_run(job.name, str(job.path), job.snapshot() | {"fingerprint": work.fingerprint},
                             opts.log_path)
    ctx = CalibrationContext(store, calibration_key(job, scan.system_prompt_keys), work.todo, run_id,
                             force=opts.recalibrate)
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM,)}
    try:
        engines = RunEngines(job, engine_factory, store, run_id, opts.clock)
        summary = _execute(job, store, run_id, engines, builder, work, opts.progress_factory, ctx)
    except BaseException as exc:
        status = "interrupted" if isinstance(exc, (Interrupted, KeyboardInterrupt)) else "failed"
        store.finish_run(run_id, status, error=str(exc) or exc.__class__.__name__)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        work.is_done.close()
    summary.rows_input, summary.rows_skipped = scan.rows, work.skipped
    summary.rows_redone, summary.redo_reasons = work.redone, work.reasons
    summary.job_counts = store.job_status_counts(job.name)
    return summary


def _work(store: Store, job: Job, scan: InputScan, retry_failed: bool) -> Work:
    """Count what the run will do against what is stored, on disk (bounded memory at any size)."""
    fingerprint, components = result_fingerprint(job)
    store.register_fingerprint(job.name, fingerprint, components)
    skipped, redone = store.input_counts(job.name, scan.ids.path, fingerprint, ok_only=retry_failed)
    reasons: set[str] = set()
    if redone and not retry_failed:
        known = store.fingerprint_components(job.name)
        stale = {e.get("fingerprint") for e in store.rows_by_fingerprint(job.name)} - {fingerprint, None}
        for fp in stale & set(known):
            reasons.update(changed_parts(known[fp], components))
    return Work(fingerprint, scan.rows - skipped, skipped, redone, sorted(reasons),
                store.done_filter(job.name, fingerprint, ok_only=retry_failed))


def _execute(job: Job, store: Store, run_id: int, engines: RunEngines, builder: PromptBuilder, work: Work,
             progress_factory, ctx: CalibrationContext) -> RunSummary:
    todo = work.todo
    clock = engines.clock
    t_start = clock()
    progress = progress_factory(todo) if progress_factory else None
    loop = _Loop(job, store, run_id, RequestBuilder(job, builder), progress, clock=clock)
    source = loop.requests(_build_ahead(job, loop.rb, work.is_done) if todo else iter(()))
    choice = None
    try:
        try:
            if todo == 0:  # every row is stored already: a rerun from cron costs no engine start
                pass
            elif job.engine.speculative == "auto":
                choice, source = calibrate(job, engines, loop, source, ctx)
            else:
                engines.start(job)
            while todo:
                engines.run(loop, source)
                if not loop.retries:
                    break
                source = loop.pop_retries()
        finally:
            loop.flush()  # rows that finished before a failure or a signal are kept
            engines.stop()
    finally:
        if progress is not None and hasattr(progress, "close"):
            progress.close()
    stats = build_stats(loop.counts, loop.tokens, engines.used, clock() - t_start, engines.load_s,
                        engines.gen_s, loop.rb.plan().prefix_share, work.skipped)
    stats["rows_redone"] = work.redone
    stats["engine_choice_json"] = json.dumps({"speculative_calibration": choice, "engines": engines.adaptations,
                                              "engine_starts_s": [round(x, 3) for x in engines.starts],
                                              "runner_loop": _loop_times(loop)})
    store.finish_run(run_id, "completed", stats=stats)
    return RunSummary(run_id, str(job.database_path), 0, 0, dict(loop.counts), stats)


def _loop_times(loop: "_Loop") -> dict:
    """Where the runner's own time went (seconds; reading and building run in a thread of their own)."""
    return {k: round(v, 3) for k, v in
            {"read_s": loop.rb.read_s, "build_s": loop.rb.build_s, **loop.timers}.items()}


def calibrate_job(job: Job, *, engine_factory: Callable[[Job], Engine] = build_engine, wait: bool = False,
                  clock: Callable[[], float] = time.perf_counter) -> dict:
    """`runner calibrate`: measure the job's speculation on its own rows (done or not) and store the
    choice for later runs. Nothing is written to the job's results."""
    scan = scan_input(job.input_path, job.spec.input)
    builder = PromptBuilder(job.model_path, job.spec.prompts.user_template)
    with JobLock(job.database_path, job.name, wait=wait):
        store = Store(job.database_path)
        loop = _Loop(job, store, None, RequestBuilder(job, builder), None, keep_results=False, clock=clock)
        source = loop.requests(_build_ahead(job, loop.rb, None))
        engines = RunEngines(job, engine_factory, store, None, clock)
        ctx = CalibrationContext(store, calibration_key(job, scan.system_prompt_keys), scan.rows, None, force=True)
        try:
            record, _ = calibrate(job, engines, loop, source, ctx)
        finally:
            engines.stop()
        return record


def _build_ahead(job: Job, rb: RequestBuilder, is_done: Optional[Callable[[list[str]], set[str]]]):
    """Read, skip done rows, plan and tokenize in a thread from now on, while the engine starts and
    then while it generates: the driver's own work stays off the engine's critical path (the
    tokenizer releases the GIL). At most BUILT_AHEAD_CHUNKS chunks wait, which bounds the token
    ids held; done rows are asked of the database a batch at a time."""
    documents = _timed(_documents(job), rb)
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


def _documents(job: Job) -> Iterator[Document]:
    """The job's rows, read lazily: by Ray Data for the ray executor, else by pyarrow."""
    if job.spec.executor == "ray":
        from runner.ray_executor import ensure_ray, ray_documents

        ensure_ray(job)  # here, in the main thread: Ray must not start in the reader's thread
        return ray_documents(job)
    return iter_documents(job.input_path, job.spec.input, job.system_prompt)


class _Loop:
    """State of one pass: in-flight requests, retries, the commit buffer and counts."""

    def __init__(self, job: Job, store: Store, run_id: Optional[int], requests: RequestBuilder, progress,
                 keep_results: bool = True, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.job, self.store, self.run_id, self.rb, self.progress = job, store, run_id, requests, progress
        self.keep_results = keep_results  # False: measure only (runner calibrate)
        self.fingerprint = result_fingerprint(job)[0]  # stored with every row: what made it
        self.timers = {"check_s": 0.0, "store_s": 0.0}  # the driver's own work on finished rows
        self.checker = OutputChecker(job.output_schema)
        self.inflight: dict[str, tuple[Request, int, Optional[str]]] = {}  # row -> (request, attempt, first status)
        self.immediate: deque[tuple[Completion, str]] = deque()
        self.retries: deque[Request] = deque()
        self.buffer: list[dict] = []
        self.counts = {s: 0 for s in STATUSES}
        self.tokens = {"prompt": 0, "completion": 0, "cached": 0}
        self.samples: list[dict] = []
        self.t0 = self.last_sample = clock()

    def requests(self, chunks) -> Iterator[Request]:
        """Built chunks (RequestBuilder.stream) -> requests for the engine; rows that cannot run
        (too long) are stored as failed on the way."""
        for key, built in chunks:
            for r in built:
                if isinstance(r, Completion):
                    self.immediate.append((r, key))
                    continue
                self.inflight[r.row_id] = (r, 1, None)
                yield r
            self.drain_immediate()

    def pop_retries(self) -> Iterator[Request]:
        while self.retries:
            yield self.retries.popleft()

    def drain_immediate(self) -> None:
        while self.immediate:
            c, key = self.immediate.popleft()
            self._store(c, key, FAILED, None, c.error, 1, None)

    def finish(self, c: Completion) -> None:
        req, attempt, first = self.inflight.pop(c.row_id)
        t0 = time.perf_counter()
        checked = self.checker.check(c, req.max_tokens)
        self.timers["check_s"] += time.perf_counter() - t0
        retry_budget = self.job.spec.sampling.retry_max_tokens
        if checked.status not in (OK, FAILED) and retry_budget and attempt == 1:
            again = replace(req, max_tokens=max(retry_budget, req.max_tokens))
            self.inflight[req.row_id] = (again, 2, checked.status)
            self.retries.append(again)
            return
        self._store(c, req.group_key, checked.status, checked.extraction_json, checked.error, attempt, first)

    def _store(self, c: Completion, group_key, status, extraction, error, attempts, first_status) -> None:
        self.buffer.append(dict(
            run_id=self.run_id, job_name=self.job.name, row_id=c.row_id, group_key=group_key, status=status,
            extraction_json=extraction, output_text=c.text, error=error, prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens, cached_prompt_tokens=c.cached_prompt_tokens,
            finish_reason=c.finish_reason, latency_ms=round(c.latency_ms, 3), preemptions=c.preemptions,
            attempts=attempts, first_status=first_status, fingerprint=self.fingerprint))
        self.counts[status] += 1
        self.tokens["prompt"] += c.prompt_tokens
        self.tokens["completion"] += c.completion_tokens
        self.tokens["cached"] += c.cached_prompt_tokens
        now = self.clock()
        if now - self.last_sample >= SAMPLE_EVERY_S:
            self.sample(now)
        if len(self.buffer) >= self.job.spec.output.commit_every_rows:
            self.flush()
        if self.progress is not None:
            self.progress.update(1)

    def sample(self, now: float) -> None:
        self.last_sample = now
        self.samples.append(dict(run_id=self.run_id, elapsed_s=round(now - self.t0, 3), rows_done=sum(self.counts.values()),
                                 prompt_tokens=self.tokens["prompt"], completion_tokens=self.tokens["completion"],
                                 cached_prompt_tokens=self.tokens["cached"]))

    def flush(self) -> None:
        if not self.keep_results:
            self.buffer, self.samples = [], []
            return
        if self.buffer or self.samples:
            self.sample(self.clock())  # every commit also marks a point on the throughput curve
        t0 = time.perf_counter()
        self.store.write_results(self.buffer, self.samples)
        self.timers["store_s"] += time.perf_counter() - t0
        self.buffer, self.samples = [], []
