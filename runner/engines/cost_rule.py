"""The cost rule of `speculative: auto`: measuring drafts costs engine starts, and a first run
measures only when the best plausible speed-up could win them back on its own rows. A decision not
to measure is stored with the pace it was made at, so that later runs apply the rule again.
"""
from __future__ import annotations

import json
from typing import Optional

NONE_PASSED = "no candidate passed verification"


def worth_measuring(cal, per_row_s: float, start_s: float, rows_left: int, candidates: int = 1) -> dict:
    """The cost rule (a first run, or a later one at the pace a first run stored): measuring
    drafts starts an engine per candidate, then the plain one again if drafts lose; it pays only if
    the best plausible speed-up (calibration.assumed_max_speedup) would save more than that on the
    rows left, at the pace (seconds of generation a row) measured without drafts."""
    remaining_s = max(rows_left, 0) * per_row_s
    win_s = remaining_s * (1 - 1 / cal.assumed_max_speedup)
    cost_s = (candidates + 1) * start_s
    return {"measure": cost_s < win_s, "cost_s": round(cost_s, 2), "win_s": round(win_s, 2),
            "rows_left": max(rows_left, 0), "engine_start_s": round(start_s, 2), "per_row_s": per_row_s}


def without_drafts(worth: dict, candidates: list) -> dict:
    """The record of running without drafts: no candidate passed verification, or (decided_by
    cost_rule) measuring them cannot pay."""
    if not candidates:
        return {"chosen_draft_tokens": 0, "skipped": NONE_PASSED}
    return {"chosen_draft_tokens": 0, "decided_by": "cost_rule",
            "skipped": f"measuring drafts would cost about {worth['cost_s']:.0f} s of engine starts, more than "
                       f"the {worth['win_s']:.0f} s they could save on the {worth['rows_left']} rows left"}


def stored_pace(cached: dict) -> Optional[float]:
    """Seconds of generation a row, when the stored calibration is a first run's decision by cost
    (not a measured choice); else None."""
    record = json.loads(cached.get("record_json") or "{}")
    if record.get("decided_by") != "cost_rule":
        return None
    return record.get("cost_rule", {}).get("per_row_s")


def stored_lengths(cached: dict, longest: int) -> list[int]:
    """Output lengths the stored calibration's slice saw, to seed a later run's admission; [] where
    it stored none (one made before they were kept) or any is not a whole number of tokens from 0 to
    `longest` (the job's max_tokens: the slice's are first attempts): then the run paces without them."""
    try:
        lengths = json.loads(cached.get("record_json") or "{}").get("output_lengths")
    except (ValueError, AttributeError):
        return []
    if not isinstance(lengths, list) or not all(type(n) is int and 0 <= n <= longest for n in lengths):
        return []
    return lengths
