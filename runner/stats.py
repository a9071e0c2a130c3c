"""The run_stats row: throughput, cache and speculation figures of one run."""
from __future__ import annotations

from typing import Optional

from runner.engines.base import EngineCounters


def _rate(num: float, den: float) -> Optional[float]:
    return num / den if den else None


def build_stats(counts: dict, tokens: dict, used: EngineCounters, wall_s: float, load_s: float,
                gen_s: float, plan_share: Optional[float], skipped: int) -> dict:
    """The run_stats row: rates are per second of generation (engine start excluded)."""
    rows = sum(counts.values())
    return dict(
        rows_total=rows, rows_skipped=skipped,
        rows_ok=counts["ok"], rows_truncated=counts["truncated"], rows_invalid_json=counts["invalid_json"],
        rows_schema_mismatch=counts["schema_mismatch"], rows_failed=counts["failed"],
        prompt_tokens=tokens["prompt"], completion_tokens=tokens["completion"], cached_prompt_tokens=tokens["cached"],
        wall_s=round(wall_s, 3), engine_load_s=round(load_s, 3), generation_s=round(gen_s, 3),
        documents_per_s=_rate(rows, gen_s) or 0.0,
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
