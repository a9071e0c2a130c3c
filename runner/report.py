"""One self-contained HTML report of a run: numbers and inline SVG plots, no external files."""
from __future__ import annotations

import html
import json
from array import array
from collections import defaultdict
from typing import Sequence

from runner.collect import SAMPLE_EVERY_S
from runner.engines import describe_settings
from runner.errors import NotFound
from runner.rows import Status
from runner.summary import killed_run_stats, one_line, run_status, stats_lines
from runner.store import Store

SECTIONS = ("summary", "throughput", "prefix-cache", "status", "tokens", "slowest-groups")
_W, _H, _PAD = 640, 220, 40
_COLORS = {Status.OK: "#2e7d32", Status.TRUNCATED: "#f9a825", Status.INVALID_JSON: "#ef6c00",
           Status.SCHEMA_MISMATCH: "#c62828", Status.FAILED: "#6a1b9a"}


def _esc(v) -> str:
    return html.escape(str(v))


def bar_chart(labels: list[str], values: list[float], fmt=lambda v: f"{v:g}", colors: list[str] | None = None) -> str:
    """Horizontal bars, one per label."""
    if not labels:
        return "<p>No data.</p>"
    top = max(max(values), 1e-9)
    row_h = 22
    h = row_h * len(labels) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{h}" role="img">']
    for i, (label, v) in enumerate(zip(labels, values)):
        y = 5 + i * row_h
        w = (_W - 260) * v / top
        color = (colors or ["#1565c0"] * len(labels))[i]
        parts.append(f'<text x="0" y="{y + 15}" font-size="12">{_esc(label)[:24]}</text>'
                     f'<rect x="170" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" fill="{color}"/>'
                     f'<text x="{175 + w:.1f}" y="{y + 15}" font-size="12">{_esc(fmt(v))}</text>')
    return "".join(parts) + "</svg>"


def line_chart(xs: list[float], ys: list[float], x_label: str, y_label: str) -> str:
    if len(xs) < 2:
        # not "the run was short": a killed run also stops sampling at its last stored row
        return (f"<p>Too few samples for a curve (one is taken at most every {SAMPLE_EVERY_S:g} s, "
                f"as rows are stored).</p>")
    x0, x1, y1 = min(xs), max(xs), max(max(ys), 1e-9)
    sx = lambda x: _PAD + (_W - 2 * _PAD) * (x - x0) / ((x1 - x0) or 1)
    sy = lambda y: _H - _PAD + (-(_H - 2 * _PAD) * y / y1)
    pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" role="img">'
            f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#444"/>'
            f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_H - _PAD}" stroke="#444"/>'
            f'<polyline points="{pts}" fill="none" stroke="#1565c0" stroke-width="2"/>'
            f'<text x="{_W / 2}" y="{_H - 8}" font-size="12" text-anchor="middle">{_esc(x_label)}</text>'
            f'<text x="4" y="{_PAD - 10}" font-size="12">{_esc(y_label)} (max {y1:.2f})</text>'
            f'<text x="{_PAD}" y="{_H - _PAD + 14}" font-size="11">{x0:.0f}</text>'
            f'<text x="{_W - _PAD}" y="{_H - _PAD + 14}" font-size="11" text-anchor="end">{x1:.0f}</text></svg>')


def histogram(values: Sequence[int], bins: int = 12) -> str:
    if not values:
        return "<p>No data.</p>"
    lo, hi = min(values), max(values)
    width = max((hi - lo) / bins, 1)
    counts = [0] * bins
    for v in values:
        counts[min(int((v - lo) / width), bins - 1)] += 1
    labels = [f"{lo + i * width:.0f}–{lo + (i + 1) * width:.0f}" for i in range(bins)]
    return bar_chart(labels, counts, fmt=lambda v: f"{v:.0f}")


_COLUMNS = ("status", "group_key", "prompt_tokens", "cached_prompt_tokens", "latency_ms", "completion_tokens")


def render_report(store: Store, run_id: int) -> str:
    """The report page of one run, as an HTML string."""
    run = store.run(run_id)
    if run is None:
        raise NotFound(f"{store.path}: no run {run_id}")
    stats = store.stats(run_id) or killed_run_stats(run)
    by_status: dict[str, int] = defaultdict(int)
    groups: dict[str, dict] = defaultdict(lambda: {"rows": 0, "prompt": 0, "cached": 0, "latency_ms": 0.0,
                                                   "max_latency_ms": 0.0})
    # A row at a time, its numbers only: a million rows' outputs never sit in memory
    prompt_tokens, completion_tokens = array("q"), array("q")
    for r in store.results_of(run_id, columns=_COLUMNS):
        by_status[r["status"]] += 1
        g = groups[r["group_key"]]
        g["rows"] += 1
        g["prompt"] += r["prompt_tokens"]
        g["cached"] += r["cached_prompt_tokens"]
        g["latency_ms"] += r["latency_ms"]
        g["max_latency_ms"] = max(g["max_latency_ms"], r["latency_ms"])
        prompt_tokens.append(r["prompt_tokens"])
        completion_tokens.append(r["completion_tokens"])
    counted, gone = store.result_counts(run_id)
    if gone:  # rows by status as the run counted them; the other charts show the rows still stored
        by_status = defaultdict(int, counted)
    body = [_summary(run, stats, by_status, gone), _throughput(store.samples(run_id)), _groups(groups, by_status),
            f'<section id="tokens"><h2>Token counts</h2><h3>Prompt tokens per row</h3>'
            f'{histogram(prompt_tokens)}'
            f'<h3>Completion tokens per row</h3>{histogram(completion_tokens)}</section>']
    style = ("body{font-family:sans-serif;margin:2em;max-width:760px}th{text-align:left;padding-right:1em}"
             "section{margin-bottom:2em}td{padding-right:1em}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>runner report: run {run_id}</title>"
            f"<style>{style}</style></head><body><h1>Run {run_id}: {_esc(run['job_name'])}</h1>{''.join(body)}</body></html>")


def _summary(run: dict, stats: dict, statuses: dict[str, int], gone: int) -> str:
    settings = json.loads(run["engine_settings_json"] or "{}")
    summary = [
        ("job", run["job_name"]), ("status", run_status(run)), ("started (UTC)", run["started_at_utc"]),
        ("ended (UTC)", run["ended_at_utc"] or "-"),
        *([("error", one_line(run["error"]))] if run.get("error") else []),
        *stats_lines(stats, statuses),
        *([("rows no longer stored", f"{gone:,} (replaced, then deleted): counted in rows by status, "
                                       "not in the other charts")] if gone else []),
        ("engine", f"{run['engine_backend'] or '-'} {run['engine_version'] or ''}"),
        *describe_settings(run["engine_backend"], settings),
    ]
    return ('<section id="summary"><h2>Summary</h2><table>'
            + "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in summary) + "</table></section>")


def _throughput(samples: list[dict]) -> str:
    xs, ys = generated_rates(samples)
    return f'<section id="throughput"><h2>Throughput over time</h2>{line_chart(xs, ys, "seconds since start", "documents/s")}</section>'


def generated_rates(samples: list[dict]) -> tuple[list[float], list[float]]:
    """(seconds since the start, documents generated a second since the point before). Failed rows
    were never generated: as in the run's documents/s, they do not count. Each point spans at least
    a second (or a hundredth of the run): one engine step's rows stored in two commits a millisecond
    apart read as thousands a second, then none. A run shorter than that has no points."""
    if len(samples) < 2:
        return [], []
    span = max(1.0, (samples[-1]["elapsed_s"] - samples[0]["elapsed_s"]) / 100)
    done = lambda s: s["rows_done"] - s["rows_failed"]  # noqa: E731
    points, a = [], samples[0]
    for b in samples[1:]:
        if b["elapsed_s"] - a["elapsed_s"] >= span:
            points.append((a, b))
            a = b
    if points and a is not samples[-1]:  # the tail, shorter than a point: into the point before
        points[-1] = (points[-1][0], samples[-1])
    return ([b["elapsed_s"] for _, b in points],
            [(done(b) - done(a)) / (b["elapsed_s"] - a["elapsed_s"]) for a, b in points])


def _groups(groups: dict[str, dict], by_status: dict[str, int]) -> str:
    """Prefix-cache hits by group, rows by status, the slowest groups."""
    keys = sorted(groups, key=lambda k: -groups[k]["rows"])
    hit = [groups[k]["cached"] / groups[k]["prompt"] if groups[k]["prompt"] else 0 for k in keys]
    mean_ms = {k: groups[k]["latency_ms"] / groups[k]["rows"] for k in keys}
    slow = sorted(keys, key=lambda k: -mean_ms[k])[:10]
    slow_rows = "".join(
        f"<tr><td>{_esc(k)}</td><td>{groups[k]['rows']}</td><td>{mean_ms[k]:.0f}</td>"
        f"<td>{groups[k]['max_latency_ms']:.0f}</td></tr>" for k in slow)
    statuses = sorted(by_status, key=lambda s: -by_status[s])
    return (f'<section id="prefix-cache"><h2>Prefix-cache hit rate by group</h2>'
            f'{bar_chart(keys, hit, fmt=lambda v: f"{100 * v:.1f}%")}</section>'
            f'<section id="status"><h2>Rows by status</h2>'
            f'{bar_chart(statuses, [by_status[s] for s in statuses], fmt=lambda v: f"{v:.0f}", colors=[_COLORS.get(s, "#555") for s in statuses])}</section>'
            f'<section id="slowest-groups"><h2>Slowest groups</h2><table><tr><th>group</th><th>rows</th>'
            f'<th>mean latency ms</th><th>max latency ms</th></tr>{slow_rows}</table></section>')
