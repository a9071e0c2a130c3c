"""End-to-end benchmark: the user's wall clock, the runner against what a user would do instead.

Every configuration is one process, timed from its start to its exit (engine start, calibration,
reading and writing included):

  plain         bench/plain_vllm.py: LLM.chat over the rows in arrival order, vLLM's defaults
  sorted        the same with the rows sorted by system prompt first
  runner        `runner run --quiet` with the calibration a first run stored (a nightly job's next night)
  runner_first  `runner run --quiet` on a fresh database: calibration included
  ray1, ray2    the runner with `executor: ray`, 1 or 2 replicas of one GPU each
  ray1ip, ...   the same with each replica's vLLM engine core in the actor's process (ip) or in a
                process of its own: forked (mp, the default), or spawned (sp: as vLLM does inside
                a Ray actor, importing vLLM again)
  spec_off, no_warm, peaks_only, no_grouping, spec_kN, xgrammar, guidance   the runner with one
                setting changed (xgrammar, guidance: a named structured_output_backend, not measure)

A case is WORKLOAD/REGIME/MODEL=CONFIGS[@ROUNDS], e.g. `invoices/tight/135m=plain,sorted,runner`.
Cases run interleaved in rounds (every configuration once per round), single-GPU runs side by
side on every GPU, then the round's multi-GPU runs; `--deadline-s` cuts the last rounds. Ratios are taken per round (runs of one round ran side by side)
and their median is reported with the min-max. Prints a table; writes JSON with every raw run.

    python bench/bench.py --model /tmp/smollm2 --out /tmp/e2e.json --deadline-s 1200
    python bench/bench.py --platform cpu --model ~/.cache/runner/models/smollm2-135m-instruct \\
        --docs 24 --cases "invoices/tight/135m=plain,sorted,runner_first,runner" --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import install_handlers  # noqa: E402
from bench.schedule import run_schedule  # noqa: E402
from bench.tasks import Task, make_tasks  # noqa: E402

DEFAULT_CASES = ("invoices/tight/135m=plain,sorted,runner_first,runner;invoices/roomy/135m=plain,runner;"
                 "invoices/tight/8b=plain,sorted,runner;incidents/tight/135m=plain,sorted,runner@2")
DEFAULT_MULTI = "invoices/roomy/135m=ray1,ray2@2"


def median_range(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values)}


def ratios(tasks: list[Task], case: str, num: str, den: str, field: str, invert: bool) -> dict:
    """Per-round ratios of two configurations of one case (num over den; `invert` for times)."""
    by = {(t.case, t.config, t.round): t.result for t in tasks if t.result and "error" not in t.result}
    out = []
    for r in sorted({t.round for t in tasks}):
        a, b = by.get((case, num, r)), by.get((case, den, r))
        if a and b and a.get(field) and b.get(field):
            out.append(b[field] / a[field] if invert else a[field] / b[field])
    return median_range(out)


# The keys: name -> (case, numerator config, denominator config, field, invert for times)
RATIO_KEYS = {
    "tight_wall_speedup": ("invoices/tight/135m", "runner", "plain", "process_s", True),
    "tight_wall_speedup_vs_sorted": ("invoices/tight/135m", "runner", "sorted", "process_s", True),
    "first_run_tight_wall_speedup": ("invoices/tight/135m", "runner_first", "plain", "process_s", True),
    "tight_gen_speedup": ("invoices/tight/135m", "runner", "plain", "documents_per_s", False),
    "roomy_wall_speedup": ("invoices/roomy/135m", "runner", "plain", "process_s", True),
    "roomy_gen_speedup": ("invoices/roomy/135m", "runner", "plain", "documents_per_s", False),
    "incidents_tight_wall_speedup": ("incidents/tight/135m", "runner", "plain", "process_s", True),
    "incidents_tight_wall_speedup_vs_sorted": ("incidents/tight/135m", "runner", "sorted", "process_s", True),
    "tight_wall_speedup_8b": ("invoices/tight/8b", "runner", "plain", "process_s", True),
    "tight_wall_speedup_8b_vs_sorted": ("invoices/tight/8b", "runner", "sorted", "process_s", True),
    "tight_gen_speedup_8b_vs_sorted": ("invoices/tight/8b", "runner", "sorted", "documents_per_s", False),
    "two_replica_wall_speedup": ("invoices/roomy/135m", "ray2", "ray1", "process_s", True),
    "two_replica_gen_speedup": ("invoices/roomy/135m", "ray2", "ray1", "documents_per_s", False),
}


def summarize(tasks: list[Task]) -> dict:
    """The issue's keys (medians of per-round ratios) and every case's per-configuration medians."""
    cases: dict = {}
    for t in tasks:
        if t.result and "error" not in t.result:
            c = cases.setdefault(t.case, {}).setdefault(t.config, {"process_s": [], "documents_per_s": [],
                                                                 "wall_documents_per_s": []})
            for k in c:
                c[k].append(t.result.get(k))
    per_case = {case: {cfg: {k: median_range(v) for k, v in fields.items()} for cfg, fields in configs.items()}
                for case, configs in cases.items()}
    out = {}
    for name, (case, num, den, field, invert) in RATIO_KEYS.items():
        case_tasks = [t for t in tasks if t.case == case]
        r = ratios(case_tasks, case, num, den, field, invert) if case_tasks else median_range([])
        out[name] = r["median"]
        out[name + "_range"] = [r["min"], r["max"], r["n"]]
    return out | {"cases": per_case}


def table(tasks: list[Task]) -> str:
    head = (f"{'case':<22} {'config':<13} {'n':>2} {'wall s (min-max)':>22} {'wall doc/s':>10} {'gen doc/s':>9} "
            f"{'hit':>6} {'preempt':>7} {'valid':>9}")
    lines = [head, "-" * len(head)]
    done: dict = {}
    for t in tasks:
        done.setdefault((t.case, t.config), []).append(t)
    for (case, config), ts in done.items():
        ok = [t.result for t in ts if t.result and "error" not in t.result]
        errs = [t.result for t in ts if t.result and "error" in t.result]
        if not ok:
            if errs:
                lines.append(f"{case:<22} {config:<13} ERROR {errs[0]['error'].strip().splitlines()[-1][:90]}")
            continue
        w = median_range([r["process_s"] for r in ok])
        med = lambda k: statistics.median([r[k] for r in ok if r.get(k) is not None] or [0])  # noqa: E731
        hit = med("prefix_cache_hit_rate")
        lines.append(f"{case:<22} {config:<13} {len(ok):>2} {w['median']:>8.1f} ({w['min']:.1f}-{w['max']:.1f}) "
                     f"{med('wall_documents_per_s'):>10.2f} {med('documents_per_s'):>9.2f} {100 * hit:>5.1f}% "
                     f"{med('preemptions'):>7.0f} {med('rows_valid'):>4.0f}/{med('rows'):.0f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the 135M model folder (its tokenizer serves the 8B shape too)")
    ap.add_argument("--platform", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="WORKLOAD/REGIME/MODEL=CONFIGS;...")
    ap.add_argument("--multi", default=DEFAULT_MULTI, help="cases that need several GPUs (run after the rest)")
    ap.add_argument("--docs", type=int, default=1024)
    ap.add_argument("--multi-docs", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--multi-repeats", type=int, default=3)
    ap.add_argument("--tight-blocks", type=int, default=1024, help="KV blocks of the tight regime (135M)")
    ap.add_argument("--tight-blocks-8b", type=int, default=3072, help="KV blocks of the tight regime (8B: ~6 GB)")
    ap.add_argument("--gpus", default="auto", help="GPU ids to run on, e.g. 0,1 (auto: all)")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    ap.add_argument("--task-timeout", type=int, default=900)
    ap.add_argument("--engine-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting for every runner configuration (YAML value), e.g. enforce_eager=true")
    ap.add_argument("--workdir", default="/tmp/rb")
    ap.add_argument("--out", default=None)
    ap.add_argument("--machine", default=None)
    ap.add_argument("--dry-run", action="store_true", help="check the cases and configurations, run nothing")
    a = ap.parse_args()
    try:
        tasks = make_tasks(a)
    except KeyError as exc:  # a misspelt case or configuration: before any GPU time is spent
        sys.exit(f"Error: {exc.args[0]}")
    print(f"{len(tasks)} runs planned", file=sys.stderr, flush=True)
    if a.dry_run:
        return
    install_handlers()  # a stopped bench stops its runs' engine processes too
    t0 = time.monotonic()

    def save() -> None:
        if a.out:
            doc = {"machine": a.machine or a.platform, "date": date.today().isoformat(),
                   "commit": os.environ.get("BENCH_COMMIT"), **summarize(tasks),
                   "settings": {k: v for k, v in vars(a).items() if k not in ("out",)},
                   "runs": [t.record() for t in tasks]}
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            part = Path(a.out).with_suffix(".part")  # a bench stopped mid-write keeps the last whole file
            part.write_text(json.dumps(doc, indent=1, default=str))
            os.replace(part, a.out)

    run_schedule(a, tasks, deadline=(t0 + a.deadline_s) if a.deadline_s else None, on_done=save)
    save()
    print(table(tasks))
    print(json.dumps({k: v for k, v in summarize(tasks).items() if k != "cases"}, indent=1))


if __name__ == "__main__":
    main()
