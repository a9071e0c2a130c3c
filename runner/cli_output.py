"""How the command line shows things: one formatter per thing, shared by every command."""
from __future__ import annotations

import json
from typing import Optional

import click

from runner.console import console


def say(message: str = "") -> None:
    """A line of the runner's own output (reaches the terminal while the engine's goes to its log)."""
    click.echo(message, file=console().out)


def warn(message: str) -> None:
    click.echo(message, file=console().err)


def one_line(message: str, limit: int = 800) -> str:
    """Messages from libraries (vLLM, pydantic) can span many lines; an error is one line."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def fmt(v, digits: int = 2, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    return f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}"


def speculation(choice_json: Optional[str]) -> str:
    """How the run chose its speculative decoding, from run_stats.engine_choice_json."""
    cal = (json.loads(choice_json) if choice_json else {}).get("speculative_calibration")
    if not cal:
        return "as configured"
    k = cal.get("chosen_draft_tokens", 0)
    what = f"{k} draft tokens" if k else "off"
    if "reused_calibration_id" in cal:
        return f"{what} (calibration #{cal['reused_calibration_id']} of {cal['measured_at_utc'][:10]}, reused)"
    if "calibration_id" in cal:
        return f"{what} (measured in {cal.get('calibration_s', 0):.1f} s, stored as calibration #{cal['calibration_id']})"
    return f"{what} ({cal.get('skipped', 'not measured')})"


def stats_table(s: dict, statuses: dict[str, int], extra: list[tuple[str, object]] = ()) -> str:
    """A run's stats row: the one rendering `runner run` and `runner stats` share."""
    return table([
        ("rows by status", ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()) if v) or "-"),
        ("documents/s", fmt(s.get("documents_per_s"))),
        ("output / total tok/s", f"{fmt(s.get('output_tokens_per_s'), 1)} / {fmt(s.get('total_tokens_per_s'), 1)}"),
        ("prefix-cache hit rate",
         f"{fmt(s.get('prefix_cache_hit_rate'), pct=True)} (plan bound {fmt(s.get('plan_prefix_share'), pct=True)})"),
        ("spec. acceptance", fmt(s.get("spec_acceptance_rate"), pct=True)),
        ("speculation", speculation(s.get("engine_choice_json"))),
        ("wall / generation s", f"{fmt(s.get('wall_s'), 1)} / {fmt(s.get('generation_s'), 1)}"),
        *extra,
    ])


def run_summary(summary) -> str:
    s = summary.stats
    rows = (f"{s['rows_total']:,} run ({summary.rows_redone:,} of them again), " if summary.rows_redone
            else f"{s['rows_total']:,} run, ")
    return f"Results: {summary.database} (run {summary.run_id})\n" + stats_table(s, summary.counts, [
        ("rows", rows + f"{summary.rows_skipped:,} already done, {summary.rows_input:,} in input"),
    ])
