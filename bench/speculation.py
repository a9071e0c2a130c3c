"""Speculative decoding measured on a job's own rows: off, ngram, and a draft distilled from the job.

For a job that has run (its ok rows and their generated token ids are stored):
  1. `runner distill` trains a draft on the rows it does not hold out (runner/distill.py);
  2. the held-out rows become a job of their own, which runs once per configuration, each a
     `runner run` process on a fresh database: no drafts, ngram at each draft length, the draft at
     each length, and `speculative: auto` choosing among ngram and the draft;
  3. `runner verify` compares greedy outputs with and without the best ngram and the best draft.
Prints a table; writes JSON with the keys distilled_acceptance, distilled_speedup_cpu,
verify_agreement, auto_vs_best_candidate and every run.

    python bench/speculation.py --job jobs/summarize.yaml --out bench/results/DATE-cpu-speculation.json
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import install_handlers, run_group  # noqa: E402


def runner_env(**extra: str) -> dict:
    """The environment of a `runner` child: this checkout first on PYTHONPATH."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def runner(*args, check=True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "runner.cli", *map(str, args)]
    proc = run_group(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=runner_env())
    if check and proc.returncode not in (0, 65):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc


def make_workload_job(kind: str, work: Path, rows: int, config: Path, model: str | None, blocks: int | None) -> Path:
    """A job over bench/workload.py's documents: `incidents` (32 short prompts, a 7-field schema
    with a list, longer outputs) or `invoices` (64 prompts of ~900 tokens, the GPU workload)."""
    from bench.workload import WORKLOADS, write_workload

    data = work / f"{kind}-data"
    prompts, words, max_tokens = {"incidents": (32, 140, 320), "invoices": (64, 650, WORKLOADS["invoices"][5])}[kind]
    write_workload(data, rows, prompts, words, kind=kind)
    engine = {"config": str(Path(config).resolve()), "speculative": None} | ({"model": model} if model else {}) | (
        {"num_gpu_blocks_override": blocks} if blocks else {})
    job = {"name": kind, "input": {"path": str(data / "documents.parquet"), "id_column": "doc_id",
                                   "text_column": "text", "system_prompt_column": "system_prompt"},
           "output_schema": str(data / "schema.json"), "engine": engine,
           "sampling": {"temperature": 0, "max_tokens": max_tokens, "seed": 0},
           "output": {"database": str(data / "results.sqlite"), "commit_every_rows": 64, "max_failed_fraction": 1.0}}
    (data / f"{kind}.yaml").write_text(yaml.safe_dump(job))
    return data / f"{kind}.yaml"


def held_out_job(job_path: Path, work: Path, holdout: float) -> dict:
    """A copy of the job whose input is its held-out rows, all paths absolute."""
    import pyarrow.parquet as pq

    from runner.distill import held_out
    from runner.input_paths import input_files
    from runner.spec import load_job

    job = load_job(job_path)
    table = pq.ParquetFile(input_files(job.input_path)[0]).read()
    ids = table.column(job.spec.input.id_column).to_pylist()
    keep = [i for i, r in enumerate(ids) if held_out(str(r), holdout)]
    pq.write_table(table.take(keep), work / "heldout.parquet")
    spec = yaml.safe_load(job_path.read_text())
    spec["input"] = spec["input"] | {"path": str(work / "heldout.parquet"), "limit": None}
    spec["output_schema"] = str(job.schema_path)
    spec["engine"] = spec["engine"] | {"config": str(job.engine_config_path)}
    spec["output"] = spec["output"] | {"max_failed_fraction": 1.0}
    return spec


def run_config(spec: dict, work: Path, name: str, speculative, calibration=None, *flags) -> dict:
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("results.sqlite*"):
        f.unlink()
    job = spec | {"engine": spec["engine"] | {"speculative": speculative} | ({"calibration": calibration} if calibration else {}),
                  "output": spec["output"] | {"database": str(d / "results.sqlite")}}
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    t0 = time.perf_counter()
    runner("run", "--quiet", "--no-verify", *flags, d / "job.yaml")
    process_s = time.perf_counter() - t0
    con = sqlite3.connect(d / "results.sqlite")
    con.row_factory = sqlite3.Row
    s = dict(con.execute("SELECT * FROM run_stats").fetchone())
    choice = json.loads(s["engine_choice_json"])
    return {"config": name, "process_s": round(process_s, 1), "documents_per_s": round(s["documents_per_s"], 3),
            "generation_s": s["generation_s"], "rows": s["rows_total"], "rows_ok": s["rows_ok"],
            "acceptance": s["spec_acceptance_rate"], "acceptance_by_position": choice.get("spec_acceptance_by_position"),
            "calibration": choice.get("speculative_calibration")}


def verify(spec: dict, work: Path, speculative: dict, rows: int) -> dict:
    d = work / "verify"
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("results.sqlite*"):
        f.unlink()
    job = spec | {"engine": spec["engine"] | {"speculative": speculative},
                  "output": spec["output"] | {"database": str(d / "results.sqlite")}}
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    runner("verify", "--rows", rows, d / "job.yaml")
    con = sqlite3.connect(d / "results.sqlite")
    agreement, fields, diffs = con.execute(
        "SELECT agreement, field_agreement_json, differences_json FROM verifications").fetchone()
    return {"setting": speculative, "agreement": agreement, "field_agreement": json.loads(fields),
            "differences": len(json.loads(diffs))}


def main() -> None:
    a = _args()
    install_handlers()
    if a.job in ("incidents", "invoices"):
        (Path(a.workdir) / a.job).mkdir(parents=True, exist_ok=True)
        job_path = make_workload_job(a.job, Path(a.workdir) / a.job, a.rows, Path(a.config), a.model, a.tight_blocks)
    else:
        job_path = Path(a.job).resolve()
    work = Path(a.workdir) / job_path.stem
    work.mkdir(parents=True, exist_ok=True)
    if runner("status", job_path, check=False).returncode != 0:
        runner("run", "--quiet", job_path)  # the rows a draft learns from
    if a.reuse_draft and (work / "draft" / "config.json").is_file():
        distilled = subprocess.CompletedProcess([], 0, stdout=f"reused {work / 'draft'}")
    else:
        distilled = runner("distill", job_path, "--out", work / "draft", "--layers", a.layers, "--epochs", a.epochs,
                           "--holdout", a.holdout)
    spec = held_out_job(job_path, work, a.holdout)
    ngram = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    draft = {"method": "draft_model", "model": str(work / "draft")}
    configs = _configs(a, ngram, draft)
    runs = []
    for rep in range(a.repeats):  # interleaved: each round runs every configuration once
        for name, speculative, calibration in configs:
            # --recalibrate: auto measures whatever it costs (the cost rule would skip so few rows).
            r = run_config(spec, work, name, speculative, calibration, *(["--recalibrate"] if calibration else []))
            runs.append(r | {"repeat": rep})
            if a.out:  # partial results survive a deadline
                Path(a.out).write_text(json.dumps({"partial": True, "machine": a.machine, "runs": runs}, indent=1))
            print(f"{r['config']:<10} {r['process_s']:>7.1f} s  {r['documents_per_s']:>6.2f} doc/s  "
                  f"accept {r['acceptance'] if r['acceptance'] is None else round(r['acceptance'], 3)} "
                  f"{r['acceptance_by_position']}", file=sys.stderr, flush=True)
    summary = summarize(runs, spec, work, ngram, draft, a.verify_rows)
    doc = {"date": date.today().isoformat(), "machine": a.machine, "commit": os.environ.get("BENCH_COMMIT"),
           "job": str(job_path), "rows_held_out": runs[0]["rows"],
           "distill": distilled.stdout, **summary, "runs": runs}
    print(json.dumps({k: v for k, v in doc.items() if k not in ("runs",)}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1, default=str))


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True, help="a job file, or `incidents` / `invoices` for bench/workload.py's")
    ap.add_argument("--rows", type=int, default=300, help="rows of a bench/workload.py job")
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2-cpu.yaml"), help="engine config of a workload job")
    ap.add_argument("--model", default=None, help="model folder of a workload job (default: the config's)")
    ap.add_argument("--tight-blocks", type=int, default=None, help="num_gpu_blocks_override of a workload job")
    ap.add_argument("--no-auto", action="store_true", help="skip the speculative: auto run")
    ap.add_argument("--machine", default="this CPU machine")
    ap.add_argument("--workdir", default="/tmp/runner-speculation")
    ap.add_argument("--holdout", type=float, default=0.2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ngram", default="2,3,4,5,6")
    ap.add_argument("--draft", default="2,3,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reuse-draft", action="store_true", help="keep a draft an earlier run of this bench distilled")
    ap.add_argument("--verify-rows", type=int, default=128, help="held-out rows each verify compares")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def _configs(a: argparse.Namespace, ngram: dict, draft: dict) -> list[tuple]:
    """(name, speculative setting, calibration) of every configuration a round runs."""
    configs = [("off", None, None)]
    configs += [(f"ngram_k{k}", ngram | {"num_speculative_tokens": int(k)}, None) for k in a.ngram.split(",")]
    configs += [(f"draft_k{k}", draft | {"num_speculative_tokens": int(k)}, None) for k in a.draft.split(",")]
    candidates = [{"method": "ngram", "options": {"prompt_lookup_max": 4, "prompt_lookup_min": 2}},
                  {"method": "draft_model", "model": draft["model"], "max_draft_tokens": max(map(int, a.draft.split(",")))}]
    if not a.no_auto:
        configs.append(("auto", "auto", {"rows": 12, "candidates": candidates}))
    return configs


def medians(runs: list[dict]) -> dict[str, dict]:
    """One row per configuration: the median run by documents/s, with the spread beside it."""
    import statistics

    out = {}
    for name in dict.fromkeys(r["config"] for r in runs):
        mine = sorted((r for r in runs if r["config"] == name), key=lambda r: r["documents_per_s"])
        rates = [r["documents_per_s"] for r in mine]
        out[name] = mine[len(mine) // 2] | {"documents_per_s": round(statistics.median(rates), 3),
                                            "documents_per_s_min_max": [rates[0], rates[-1]],
                                            "process_s": round(statistics.median(r["process_s"] for r in mine), 1)}
    return out


def summarize(runs: list[dict], spec: dict, work: Path, ngram: dict, draft: dict, verify_rows: int) -> dict:
    by = medians(runs)
    off = by["off"]["documents_per_s"]
    fixed = {n: r for n, r in by.items() if n != "auto"}
    best_draft = max((r for n, r in by.items() if n.startswith("draft")), key=lambda r: r["documents_per_s"])
    best_ngram = max((r for n, r in by.items() if n.startswith("ngram")), key=lambda r: r["documents_per_s"])
    best = max(fixed.values(), key=lambda r: r["documents_per_s"])
    rows = min(by["off"]["rows"], verify_rows)
    cal = (by["auto"]["calibration"] if "auto" in by else None) or {}
    picked = cal.get("chosen") or {}
    kind = {"ngram": "ngram", "draft_model": "draft"}.get(picked.get("method"), "off")
    chosen_name = f"{kind}_k{picked.get('num_speculative_tokens')}" if picked else "off"
    chosen = by.get(chosen_name)  # None: auto chose a length the fixed runs did not include
    k_draft = int(best_draft["config"].split("_k")[1])
    k_ngram = int(best_ngram["config"].split("_k")[1])
    verified = [verify(spec, work, draft | {"num_speculative_tokens": k_draft}, rows),
                verify(spec, work, ngram | {"num_speculative_tokens": k_ngram}, rows)]
    return {
        "distilled_acceptance": best_draft["acceptance"], "distilled_best_k": k_draft,
        "distilled_speedup_cpu": round(best_draft["documents_per_s"] / off, 3),
        "ngram_best_k": k_ngram, "ngram_speedup_cpu": round(best_ngram["documents_per_s"] / off, 3),
        "verify_agreement": verified[0]["agreement"], "verify_agreement_ngram": verified[1]["agreement"],
        # What auto chose, run as a fixed setting, against the best fixed setting (auto's own run
        # also paid for its calibration slices: auto_documents_per_s).
        "auto_vs_best_candidate": round(chosen["documents_per_s"] / best["documents_per_s"], 3)
        if "auto" in by and chosen else None,
        "auto_choice": chosen_name if "auto" in by else None,
        "auto_documents_per_s": by["auto"]["documents_per_s"] if "auto" in by else None,
        "off_process_s": by["off"]["process_s"], "distilled_process_s": best_draft["process_s"],
        "best_fixed": best["config"], "verifications": verified, "medians": by,
    }


if __name__ == "__main__":
    main()
