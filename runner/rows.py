"""The rows the runner stores, typed, and the one place that names their columns.

The run loop builds ResultRows and a StatsRow; the store writes them; stats, export, report and
the CLI read the same names from here.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Optional

from runner.engines.base import EngineCounters


class Status(str, Enum):
    """What became of an input row; every status counts as done for resume."""

    OK = "ok"
    TRUNCATED = "truncated"  # cut off at max_tokens
    INVALID_JSON = "invalid_json"
    SCHEMA_MISMATCH = "schema_mismatch"
    FAILED = "failed"  # never generated: too long, a prompt that cannot be built, rejected by the engine

    def __str__(self) -> str:
        return self.value


STATUSES = tuple(s.value for s in Status)


@dataclass
class ResultRow:
    """One row of `results`: the extraction of one input row and what it cost."""

    run_id: int
    job_name: str
    row_id: str
    group_key: str
    status: str
    extraction_json: Optional[str]
    output_text: Optional[str]
    error: Optional[str]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    finish_reason: Optional[str]
    latency_ms: float
    preemptions: int
    attempts: int
    first_status: Optional[str]  # the first attempt's status, when the row was retried
    fingerprint: Optional[str]  # what made it (runner/fingerprint.py)
    output_token_ids_json: Optional[str] = None  # the generated token ids (what `runner distill` learns)
    # input.on_too_long: truncate: the document's tokens cut so that the prompt fits (None: not cut)
    document_tokens_cut: Optional[int] = None

    def values(self, created_at_utc: str) -> tuple:
        """In RESULT_COLUMNS order."""
        return (*(getattr(self, f) for f in _RESULT_FIELDS), created_at_utc)


_RESULT_FIELDS = tuple(f.name for f in fields(ResultRow))
# every column of `results` a result writes: not its id, nor --restart's set_aside_at_utc
RESULT_COLUMNS = (*_RESULT_FIELDS, "created_at_utc")
# What an export holds of each result: these, then the extraction's fields as columns, then
# EXPORT_COLUMNS_ADDED (columns added later go last, so that readers by position keep working).
EXPORT_COLUMNS = ("row_id", "group_key", "status", "error", "prompt_tokens", "completion_tokens",
                  "cached_prompt_tokens", "finish_reason", "latency_ms", "attempts", "first_status", "extraction_json")
# which run made the row, with what job (a fingerprint: model, prompts, schema...), when, and the
# model's raw text (what an invalid or cut-off row said)
EXPORT_COLUMNS_ADDED = ("run_id", "fingerprint", "created_at_utc", "output_text", "document_tokens_cut")


def _rate(num: float, den: float) -> Optional[float]:
    return num / den if den else None


@dataclass
class StatsRow:
    """One row of `run_stats`: rates are per second of generation (engine start excluded)."""

    rows_total: int
    rows_skipped: int
    rows_redone: int
    rows_ok: int
    rows_truncated: int
    rows_invalid_json: int
    rows_schema_mismatch: int
    rows_failed: int
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    wall_s: float
    engine_load_s: float
    generation_s: float
    documents_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: Optional[float]
    plan_prefix_share: Optional[float]
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_acceptance_rate: Optional[float]
    preemptions: int
    engine_choice_json: Optional[str] = None  # what the run chose and adapted, and where its time went

    @classmethod
    def build(cls, counts: dict[str, int], tokens: dict[str, int], used: EngineCounters, *, wall_s: float,
              load_s: float, gen_s: float, plan_share: Optional[float], skipped: int, redone: int) -> "StatsRow":
        rows = sum(counts.values())
        generated = rows - counts.get(Status.FAILED.value, 0)  # a failed row never reached generation
        return cls(
            rows_total=rows, rows_skipped=skipped, rows_redone=redone,
            **{f"rows_{s}": counts.get(s, 0) for s in STATUSES},
            prompt_tokens=tokens["prompt"], completion_tokens=tokens["completion"], cached_prompt_tokens=tokens["cached"],
            wall_s=round(wall_s, 3), engine_load_s=round(load_s, 3), generation_s=round(gen_s, 3),
            documents_per_s=_rate(generated, gen_s) or 0.0,
            output_tokens_per_s=_rate(tokens["completion"], gen_s) or 0.0,
            total_tokens_per_s=_rate(tokens["prompt"] + tokens["completion"], gen_s) or 0.0,
            prefix_cache_queries=used.prefix_cache_queries, prefix_cache_hits=used.prefix_cache_hits,
            prefix_cache_hit_rate=_rate(used.prefix_cache_hits, used.prefix_cache_queries),
            plan_prefix_share=plan_share,
            spec_drafts=used.spec_drafts, spec_draft_tokens=used.spec_draft_tokens,
            spec_accepted_tokens=used.spec_accepted_tokens,
            spec_acceptance_rate=_rate(used.spec_accepted_tokens, used.spec_draft_tokens),
            preemptions=used.preemptions,
        )

    def as_dict(self) -> dict:
        return asdict(self)
