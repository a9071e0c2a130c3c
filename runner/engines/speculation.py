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


def binding_failure(verifications: list[dict], min_agreement: float, settings: Optional[str],
                    enough_rows: int) -> Optional[dict]:
    """Of a setting's stored verifications (newest first), the failure that keeps it from running
    now, with `settings` (fingerprint.verification_settings). A failure stands until a later pass
    lifts it: one over as many rows (or `enough_rows`, the job's verify.rows), made with the
    failure's settings or with the run's own (any, for a failure stored before they were recorded).
    A pass under other settings (one request at a time) or over a handful of rows lifts nothing:
    drafts that change outputs in batches may not change them alone. None where no failure stands."""
    def lifts(p: dict, f: dict) -> bool:
        made_with = f.get("settings_sha256")
        return p["rows"] >= min(f["rows"], enough_rows) and (
            made_with is None or p.get("settings_sha256") in (made_with, settings))

    ok = [passes(v["agreement"], min_agreement, Baseline.of(v)) for v in verifications]
    for i, f in enumerate(verifications):
        if not ok[i] and not any(ok[j] and lifts(p, f) for j, p in enumerate(verifications[:i])):
            return f
    return None


@dataclass(frozen=True)
class Baseline:
    """`runner verify --baseline`: how the drafts' changes compare with the engine's own, row by row."""

    agreement: float  # share of rows two runs without drafts agree on
    drafts_only: Optional[int] = None  # rows the drafts changed where the runs without drafts agree
    engine_only: Optional[int] = None  # rows the runs without drafts differ on, unchanged by the drafts

    @classmethod
    def of(cls, v) -> Optional["Baseline"]:
        """From a stored verification (a row or a Verification); None without a baseline."""
        get = v.get if isinstance(v, dict) else lambda k: getattr(v, k, None)
        if get("baseline_agreement") is None:
            return None
        return cls(get("baseline_agreement"), get("rows_changed_by_drafts_only"), get("rows_changed_by_engine_only"))


FALSE_FAIL = 0.025  # how often a setting that changes no more than the engine fails the sign test


def passes(agreement: float, min_agreement: float, baseline: Optional[Baseline] = None) -> bool:
    """A setting passes when it changes no more outputs than min_agreement allows. Where the engine
    itself changes more than that between two runs without drafts (bf16 on a GPU), it passes
    unless the drafts change clearly more rows than the engine does (drafts_change_more)."""
    if agreement >= min_agreement:
        return True
    if baseline is None or baseline.agreement >= min_agreement:
        return False  # the engine repeats itself: every change is the drafts'
    if baseline.drafts_only is None or baseline.engine_only is None:  # stored before the row counts were
        return agreement >= baseline.agreement
    return not drafts_change_more(baseline.drafts_only, baseline.engine_only)


def drafts_change_more(drafts_only: int, engine_only: int) -> bool:
    """Sign test on the rows that only one of the two changed: if the drafts change no more than the
    engine, each such row is as likely the drafts' as the engine's (a fair coin). True when the
    drafts' share is one a fair coin gives less often than FALSE_FAIL (one-sided, exact)."""
    m = drafts_only + engine_only
    if m == 0:
        return False
    tail = sum(math.comb(m, k) for k in range(drafts_only, m + 1))
    return tail / 2 ** m < FALSE_FAIL


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
