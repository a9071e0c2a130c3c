"""How fast the runner's generation could be on a cache-bound shape, from a lease's own runs.

A decoding step costs a fixed part (the weights read once, launches: bench/step_cost.py) plus a part
per request in it. Every output token is one request in one step (no drafts), so over a run the
per-request part of decoding sums to the same whatever the order; what an order changes beyond the
steps is prefill (prefix hits, a preempted request's recompute), and a runner run whose hits reach
the plan's bound has no prefill left to save. Given a runner run's generation time and steps, and
the fixed cost a step, this prints what that run would have taken

- at plain sorted's step count (sorted overcommits and preempts to get there),
- with every step at the most requests the run ever held (output tokens / max in flight steps: no
  ramp at the start and no tail at the end, fewer steps than any real run), and
- that plus one mean output length of steps: a linear ramp and a linear tail, each an output long,
  at half strength on average (about what a run pays that never overcommits the cache, where
  every output runs about as long),

each against the sorted run of the same round: bounds on what scheduling can win, not forecasts.
Runs with several engines (drafts measured) or several replicas are refused: their steps and
tokens do not add up this way.

    python bench/gen_bound.py bench/results/2026-12-06-nvidia-h200-8b-stored.json \\
        --step-cost bench/results/2026-12-05-nvidia-h100-8b-step-cost.json --out /tmp/bound.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def runner_steps(run: dict) -> tuple[int, int]:
    """The run's engine steps and the most requests it held at once: one engine of one replica,
    decoding without drafts, else SystemExit (see the module's docstring)."""
    where = f"{run['config']} round {run['round']}"
    if len(run["engines"]) != 1:
        raise SystemExit(f"Error: {where}: {len(run['engines'])} engines (drafts measured); one is needed")
    if (run.get("calibration") or {}).get("chosen_draft_tokens"):
        raise SystemExit(f"Error: {where}: it decoded with drafts, more than one token a request a step")
    engine = run["engines"][0]
    if len(engine.get("replicas", [engine])) != 1:
        raise SystemExit(f"Error: {where}: {len(engine['replicas'])} replicas; one is needed")
    engine = engine["replicas"][0] if "replicas" in engine else engine
    return engine["loop"]["steps"], engine["max_admitted"]


def bounds(runs: list[dict], case: str, fixed_ms: float) -> list[dict]:
    """One row per round that has both a runner run and a sorted run of `case`."""
    by: dict[tuple[str, int], dict] = {}
    for r in runs:
        if r["case"] == case:
            if (r["config"], r["round"]) in by:
                raise SystemExit(f"Error: two {r['config']} runs of {case} in round {r['round']}")
            by[(r["config"], r["round"])] = r
    rows = []
    for (config, rnd), run in sorted(by.items(), key=lambda kv: kv[0][1]):
        sorted_run = by.get(("sorted", rnd))
        if config != "runner" or sorted_run is None:
            continue
        steps, held = runner_steps(run)
        fixed_s = fixed_ms / 1e3
        per_request_s = run["generation_s"] - steps * fixed_s  # the same for any order of the same tokens
        full_steps = -(-run["completion_tokens"] // held)
        ramp_and_tail = round(run["completion_tokens"] / run["rows"])  # one mean output of steps
        at_sorted = per_request_s + sorted_run["engine_steps"] * fixed_s
        at_full = per_request_s + full_steps * fixed_s
        at_ramped = at_full + ramp_and_tail * fixed_s
        base = sorted_run["generation_s"]
        rows.append({"round": rnd, "runner_steps": steps, "sorted_steps": sorted_run["engine_steps"],
                     "max_in_flight": held, "full_steps": full_steps, "ramp_and_tail_steps": ramp_and_tail,
                     "runner_gen_s": run["generation_s"], "sorted_gen_s": base,
                     "per_request_part_s": round(per_request_s, 2),
                     "measured_vs_sorted": round(base / run["generation_s"], 3),
                     "at_sorted_steps_vs_sorted": round(base / at_sorted, 3),
                     "at_full_steps_vs_sorted": round(base / at_full, 3),
                     "with_ramp_and_tail_vs_sorted": round(base / at_ramped, 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a bench.py results file with runner and sorted runs")
    ap.add_argument("--case", default="invoices/tight/8b")
    ap.add_argument("--step-cost", type=Path, help="a step_cost.py results file: its json fit's fixed ms")
    ap.add_argument("--fixed-ms", type=float, help="the fixed cost of a step, instead of --step-cost's")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.fixed_ms is None and a.step_cost is None:
        ap.error("give --step-cost or --fixed-ms")
    cost = json.loads(a.step_cost.read_text()) if a.step_cost else None
    fixed_ms = a.fixed_ms if a.fixed_ms is not None else cost["fits"]["json"]["fixed_ms"]
    results = json.loads(a.results.read_text())
    rows = bounds(results["runs"], a.case, fixed_ms)
    if not rows:
        raise SystemExit(f"Error: {a.results}: no round with both a runner and a sorted run of {a.case}")
    cols = ["round", "runner_steps", "sorted_steps", "max_in_flight", "full_steps", "per_request_part_s",
            "measured_vs_sorted", "at_sorted_steps_vs_sorted", "at_full_steps_vs_sorted",
            "with_ramp_and_tail_vs_sorted"]
    print(" ".join(f"{c:>14}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]:>14}" for c in cols))
    medians = {c: round(statistics.median(r[c] for r in rows), 3) for c in cols[6:]}
    print("medians:", medians, f"(a step's fixed part {fixed_ms} ms)")
    if a.out:
        a.out.write_text(json.dumps({"results": str(a.results), "machine": results.get("machine"),
                                     "commit": results.get("commit"), "case": a.case, "fixed_ms": fixed_ms,
                                     "fixed_ms_from": str(a.step_cost) if a.fixed_ms is None else "--fixed-ms",
                                     "fixed_ms_machine": cost.get("machine") if cost and a.fixed_ms is None else None,
                                     "medians": medians, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
