"""Speculative settings: vLLM's speculative_config for a candidate, and predicting the best draft
length from one measured slice (pure functions: no engine, no database)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from runner.engine_config import CandidateSpec, SpeculativeSpec
from runner.engines.sequence import Phase
from runner.spec import Job


@dataclass
class Candidate:
    """A candidate ready to measure: its speculative_config without the draft length."""

    name: str  # e.g. "ngram", "draft_model:/models/draft"
    base: dict
    max_draft_tokens: int


def candidate(c: CandidateSpec, model: Optional[str], default_max: int) -> Candidate:
    base = {"method": c.method, **c.options} | ({"model": model} if model else {})
    return Candidate(c.method + (f":{model}" if model else ""), base, c.max_draft_tokens or default_max)


def setting_key(speculative: Optional[dict]) -> Optional[dict]:
    """What a verification is about: the method and its draft, whatever the draft length."""
    return {k: v for k, v in speculative.items() if k != "num_speculative_tokens"} if speculative else None


def passes(agreement: float, baseline: Optional[float], min_agreement: float, rows: int = 0) -> bool:
    """A setting passes when it changes no more outputs than min_agreement allows, or, measured
    against two runs without drafts (`verify --baseline`), no more than the engine changes on its
    own, within the sampling noise of the rows compared (see noise_margin)."""
    if agreement >= min_agreement:
        return True
    return baseline is not None and agreement >= baseline - noise_margin(agreement, baseline, rows)


def noise_margin(agreement: float, baseline: float, rows: int) -> float:
    """Two standard errors of the difference between two shares measured on `rows` rows: where
    the engine alone changes a third of the rows (bf16 on an H200), two equal settings measured on
    128 rows differ by up to ~0.12 about one time in 40. Without a row count, no margin."""
    if rows <= 0:
        return 0.0
    return 2 * math.sqrt((agreement * (1 - agreement) + baseline * (1 - baseline)) / rows)


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
