"""Do drafts change greedy outputs more than the engine changes them on its own?

`runner verify --baseline` on a bench/workload.py job: the same rows run twice without drafts and
once with the setting. Each mode runs as its own process, on its own GPU where there are several,
side by side: `default` (vLLM as configured) and `batch_invariant` (VLLM_BATCH_INVARIANT=1:
vLLM's kernels that give a row the same numerics whatever else is in the batch; NVIDIA compute
capability 8.0 or higher). Prints a table; writes JSON with each mode's agreements.

    python bench/verify_baseline.py --model /tmp/smollm2 --config configs/smollm2-h200.yaml \\
        --tight-blocks 1024 --out /tmp/verify.json
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

from bench.procs import finish, install_handlers, spawn  # noqa: E402
from bench.speculation import make_workload_job, runner_env  # noqa: E402

MODES = {"default": {}, "batch_invariant": {"VLLM_BATCH_INVARIANT": "1"}}


def start(mode: str, job: Path, rows: int, gpu: str | None) -> tuple[subprocess.Popen, float]:
    env = runner_env(**MODES[mode])
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    cmd = [sys.executable, "-m", "runner.cli", "verify", "--baseline", "--rows", str(rows), str(job)]
    return spawn(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), time.monotonic()


def stored(job: Path) -> dict:
    database = yaml.safe_load(job.read_text())["output"]["database"]
    con = sqlite3.connect(database)
    row = con.execute("SELECT setting_json, rows, agreement, baseline_agreement, field_agreement_json "
                      "FROM verifications ORDER BY id DESC LIMIT 1").fetchone()
    con.close()
    return {"setting": json.loads(row[0]), "rows": row[1], "agreement": row[2], "baseline_agreement": row[3],
            "field_agreement": json.loads(row[4])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2-h200.yaml"))
    ap.add_argument("--rows", type=int, default=128, help="rows each verify compares")
    ap.add_argument("--tight-blocks", type=int, default=None, help="num_gpu_blocks_override")
    ap.add_argument("--draft-tokens", type=int, default=3, help="ngram draft length")
    ap.add_argument("--modes", default="default,batch_invariant")
    ap.add_argument("--gpus", default=None, help="one GPU id per mode, e.g. 0,1 (default: as visible)")
    ap.add_argument("--workdir", default="/tmp/runner-verify")
    ap.add_argument("--machine", default="this machine")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    install_handlers()

    modes = a.modes.split(",")
    gpus = a.gpus.split(",") if a.gpus else [None] * len(modes)
    ngram = {"method": "ngram", "num_speculative_tokens": a.draft_tokens, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    procs = {}
    for mode, gpu in zip(modes, gpus):
        job = make_workload_job("invoices", Path(a.workdir) / mode, a.rows, Path(a.config), a.model, a.tight_blocks)
        spec = yaml.safe_load(job.read_text())
        spec["engine"]["speculative"] = ngram
        job.write_text(yaml.safe_dump(spec))
        procs[mode] = (job, *start(mode, job, a.rows, gpu))
    results = {}
    for mode, (job, proc, t0) in procs.items():
        out, err = finish(proc)
        results[mode] = {"process_s": round(time.monotonic() - t0, 1), "returncode": proc.returncode,
                         "output": out[-3000:], "error": err[-3000:]}
        if proc.returncode == 0:
            results[mode] |= stored(job)
    print(f"{'mode':<18}{'rows':>6}{'drafts vs none':>16}{'none vs none':>14}{'process s':>11}")
    for mode, r in results.items():
        if r["returncode"]:
            print(f"{mode:<18} failed ({r['returncode']}): {r['error'][-300:]}")
        else:
            print(f"{mode:<18}{r['rows']:>6}{r['agreement']:>16.3f}{r['baseline_agreement']:>14.3f}{r['process_s']:>11}")
    if a.out:
        doc = {"machine": a.machine, "date": date.today().isoformat(), "commit": os.environ.get("BENCH_COMMIT"),
               "workload": "invoices", "tight_blocks": a.tight_blocks, "setting": ngram, "modes": results}
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
