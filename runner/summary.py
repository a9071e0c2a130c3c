"""How a run's stats read for people: the lines `runner run`, `runner stats` and the report share."""
from __future__ import annotations

import json
import unicodedata
from datetime import datetime
from typing import Optional


def fmt(v, digits: int = 2, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    return f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}"


def plural(n: int, word: str) -> str:
    """`1 row`, `2 rows`: a count and its noun (the last word takes the s)."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def speculation(choice_json: Optional[str]) -> str:
    """How the run chose its speculative decoding, from run_stats.engine_choice_json."""
    cal = (json.loads(choice_json) if choice_json else {}).get("speculative_calibration")
    if not cal:
        return "as configured"
    k = cal.get("chosen_draft_tokens", 0)
    what = f"{k} draft tokens" if k else "off"
    why = f"; measured again: {cal['remeasured_because']}" if cal.get("remeasured_because") else ""
    if cal.get("decided_by") == "cost_rule":  # drafts were not measured: the rule's reason is the news
        ref = cal.get("reused_calibration_id") or cal.get("calibration_id")
        again = ", reused" if "reused_calibration_id" in cal else ""
        return f"{what} ({cal.get('skipped', 'not worth measuring')}; by the cost rule of calibration #{ref}{again}{why})"
    if "reused_calibration_id" in cal:
        return f"{what} (calibration #{cal['reused_calibration_id']} of {cal['measured_at_utc'][:10]}, reused)"
    if "calibration_id" in cal and "skipped" in cal:  # decided without measuring drafts (a batch over max_batch)
        return f"{what} ({cal['skipped']}; stored as calibration #{cal['calibration_id']}{why})"
    if "calibration_id" in cal:
        return (f"{what} (measured in {cal.get('calibration_s', 0):.1f} s, stored as calibration "
                f"#{cal['calibration_id']}{why})")
    return f"{what} ({cal.get('skipped', 'not measured')}{why})"


def stats_lines(s: dict, statuses: dict[str, int]) -> list[tuple[str, str]]:
    """A run's stats row as (label, text) lines."""
    return [
        ("rows by status", ", ".join(f"{k} {v:,}" for k, v in sorted(statuses.items()) if v) or "-"),
        ("documents/s", fmt(s.get("documents_per_s"))),
        ("output / total tok/s", f"{fmt(s.get('output_tokens_per_s'), 1)} / {fmt(s.get('total_tokens_per_s'), 1)}"),
        # no bound where the run planned nothing (every row stored already) or was stopped, nor
        # beside no hit rate (idle runs of older versions stored a bound of 0)
        ("prefix-cache hit rate", fmt(s.get("prefix_cache_hit_rate"), pct=True) + (
            f" (plan bound {fmt(s.get('plan_prefix_share'), pct=True)})"
            if s.get("plan_prefix_share") is not None and s.get("prefix_cache_hit_rate") is not None else "")),
        ("spec. acceptance", fmt(s.get("spec_acceptance_rate"), pct=True)),
        ("speculation", speculation(s.get("engine_choice_json"))),
        ("wall / generation s", f"{fmt(s.get('wall_s'), 1)} / {fmt(s.get('generation_s'), 1)}"
         + (" (wall to its last stored row: killed, no stats stored)" if s.get("wall_to_last_row") else "")),
    ]


def killed_run_stats(r: dict) -> dict:
    """A run killed outright stored no stats: its wall time is known to its last stored row (the
    end the next run gave it), which `stats` and the report show for it."""
    if r["status"] != "interrupted" or not (r.get("started_at_utc") and r.get("ended_at_utc")):
        return {}
    if r["ended_at_utc"] == r["started_at_utc"]:  # no row stored: ended at its start, its wall unknown
        return {}
    try:
        took = datetime.fromisoformat(r["ended_at_utc"]) - datetime.fromisoformat(r["started_at_utc"])
    except (TypeError, ValueError):  # a time written by hand or by another tool: no wall rather than a traceback
        return {}
    return {"wall_s": round(took.total_seconds(), 3), "wall_to_last_row": True}


def process_gone(run: dict) -> Optional[bool]:
    """For a run still marked running: whether its process has ended without finishing it (killed;
    the next run of the job marks it interrupted). None for a run that ended, or ran on another host."""
    import socket

    from runner.lock import process_alive

    if run["status"] != "running" or not run.get("pid") or run.get("host") != socket.gethostname():
        return None
    return not process_alive(run["pid"])


def run_status(run: dict) -> str:
    """A run's status as stats and reports show it: a killed run still marked running says so."""
    gone = (f" (its process {run.get('pid')} is gone: killed, or quit by a second Ctrl-C; the next run marks it"
            " interrupted)")
    return run["status"] + (gone if process_gone(run) else "")


def one_line(message: str, limit: int = 800) -> str:
    """Messages from libraries (vLLM, pydantic) can span many lines; an error is one line. Control
    characters (the NULs of binary data a library quotes) are written as escapes, not sent to the terminal."""
    text = " ".join(message.split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."  # cut first: an escape stays whole
    return escaped(text)


def escaped(text: str, backslashes: bool = False) -> str:
    """Text with its control characters (newlines, escape sequences) written as escapes, nothing else
    changed. With backslashes, `\\` too, so that text that holds `\\x0a` reads apart from a newline
    (a model's output, where a difference may be in its whitespace); invisible formatting characters
    (bidirectional overrides) are escaped then as well."""
    def one(c: str) -> str:
        if unicodedata.category(c) == "Cc" or backslashes and unicodedata.category(c) == "Cf":
            return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
        return "\\\\" if backslashes and c == "\\" else c
    return "".join(map(one, text))
