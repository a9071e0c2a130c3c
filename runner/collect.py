"""What happens to each finished row: checked, retried once or stored, in commit batches.

A ResultCollector lives for one run. It hands requests to the engine (noting which are in flight),
takes each Completion back, checks it against the schema, queues a retry when the retry policy
says so, and buffers ResultRows that it commits every `output.commit_every_rows` rows in one
transaction, with a throughput sample every few seconds for reports.
"""
from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Optional, Protocol

from runner.engines import Completion, Request
from runner.outputs import OutputChecker, retry_tokens
from runner.requests import RequestBuilder
from runner.rows import STATUSES, ResultRow, Status
from runner.signals import stops_deferred
from runner.spec import Job
from runner.store import Store

SAMPLE_EVERY_S = 2.0  # throughput samples for reports


class Progress(Protocol):
    def update(self, n: int = 1) -> object: ...


@dataclass
class InFlight:
    request: Optional[Request]  # None for a row that failed before it could run
    attempt: int
    first_status: Optional[str]  # the first attempt's status, on a retry


class ResultCollector:
    def __init__(self, job: Job, store: Store, run_id: Optional[int], requests: RequestBuilder,
                 progress: Optional[Progress], fingerprint: Optional[str], keep_results: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self.job, self.store, self.run_id, self.rb, self.progress = job, store, run_id, requests, progress
        self.fingerprint = fingerprint  # stored with every row: what made it
        self.keep_results = keep_results  # False: measure only (runner calibrate)
        self.clock = clock
        self.checker = OutputChecker(job.output_schema)
        self.in_flight: dict[str, InFlight] = {}  # row id -> its request
        self.retries: deque[Request] = deque()
        self.buffer: list[ResultRow] = []
        self.samples: list[dict] = []
        self.counts = {s: 0 for s in STATUSES}
        self.documents_cut = 0  # rows stored with their document cut to fit (input.on_too_long: truncate)
        self.tokens = {"prompt": 0, "completion": 0, "cached": 0}
        self.timers = {"check_s": 0.0, "store_s": 0.0}  # the driver's own work on finished rows
        self.recorded: dict[str, tuple] = {}  # without keep_results: row id -> (status, extraction, text)
        self.t0 = self.last_sample = clock()

    @property
    def rows_done(self) -> int:
        return sum(self.counts.values())

    def requests(self, chunks: Iterable[tuple[str, list]]) -> Iterator[Request]:
        """Built chunks (RequestBuilder.stream) -> requests for the engine; rows that cannot run are
        stored as failed on the way."""
        for key, built in chunks:
            for r in built:
                if isinstance(r, Completion):
                    self._store(r, key, Status.FAILED, None, r.error, InFlight(None, 1, None))
                else:
                    self.in_flight[r.row_id] = InFlight(r, 1, None)
                    yield r

    def pop_retries(self) -> Iterator[Request]:
        while self.retries:
            yield self.retries.popleft()

    def finish(self, c: Completion) -> None:
        """A finished row: checked, then retried once or buffered for the next commit."""
        f = self.in_flight.pop(c.row_id)
        t0 = time.perf_counter()
        checked = self.checker.check(c, f.request.max_tokens)
        self.timers["check_s"] += time.perf_counter() - t0
        room = self.rb.max_model_len - len(f.request.prompt_token_ids)  # vLLM stops a request there
        budget = retry_tokens(checked, f.attempt, f.request.max_tokens, self.job.spec.sampling, room)
        if budget is not None:
            again = replace(f.request, max_tokens=budget, attempt=f.attempt + 1)
            self.in_flight[c.row_id] = InFlight(again, f.attempt + 1, checked.status)
            self.retries.append(again)
            self.rb.count_retry(again)
            return
        self._store(c, f.request.group_key, checked.status, checked.extraction_json, checked.error, f)

    def _store(self, c: Completion, group_key: str, status: Status, extraction: Optional[str],
               error: Optional[str], f: InFlight) -> None:
        if not self.keep_results:
            self.recorded[c.row_id] = (status.value, extraction, c.text)
        cut = (f.request.document_tokens_cut or None) if f.request is not None else None
        self.buffer.append(ResultRow(
            run_id=self.run_id, job_name=self.job.name, row_id=c.row_id, group_key=group_key, status=status.value,
            extraction_json=extraction, output_text=c.text, error=error, prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens, cached_prompt_tokens=c.cached_prompt_tokens,
            finish_reason=c.finish_reason, latency_ms=round(c.latency_ms, 3), preemptions=c.preemptions,
            attempts=f.attempt, first_status=f.first_status, fingerprint=self.fingerprint,
            output_token_ids_json=json.dumps(c.token_ids) if c.token_ids else None, document_tokens_cut=cut))
        self.counts[status.value] += 1
        self.documents_cut += cut is not None
        if status is not Status.FAILED:  # a failed row never reached the engine: its prompt is not speed
            self.tokens["prompt"] += c.prompt_tokens
        self.tokens["completion"] += c.completion_tokens
        self.tokens["cached"] += c.cached_prompt_tokens
        now = self.clock()
        if now - self.last_sample >= SAMPLE_EVERY_S:
            self._sample(now)
        if len(self.buffer) >= self.job.spec.output.commit_every_rows:
            self.flush()
        if self.progress is not None:
            self.progress.update(1)

    def _sample(self, now: float) -> None:
        self.last_sample = now
        self.samples.append(dict(run_id=self.run_id, elapsed_s=round(now - self.t0, 3), rows_done=self.rows_done,
                                 rows_failed=self.counts[Status.FAILED.value],
                                 prompt_tokens=self.tokens["prompt"], completion_tokens=self.tokens["completion"],
                                 cached_prompt_tokens=self.tokens["cached"]))

    def flush(self) -> None:
        """Commit the buffered rows and samples in one transaction."""
        if not self.keep_results:
            self.buffer, self.samples = [], []
            return
        if self.buffer or self.samples:
            self._sample(self.clock())  # every commit also marks a point on the throughput curve
        t0 = time.perf_counter()
        with stops_deferred():  # committed and let go of together: a stop between stored them twice
            self.store.write_results(self.buffer, self.samples)
            self.buffer, self.samples = [], []
        self.timers["store_s"] += time.perf_counter() - t0

    def times(self) -> dict:
        """Where the runner's own time went (seconds; reading and building run in a thread of their own)."""
        return {k: round(v, 3) for k, v in
                {"read_s": self.rb.read_s, "build_s": self.rb.build_s, **self.timers}.items()}
