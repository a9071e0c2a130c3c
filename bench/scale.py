"""The runner's own cost at scale: memory and throughput with the fake engine (no generation).

For each size, makes an N-row Parquet input (8 system prompts of ~400 tokens, bodies of ~60 words),
then runs `runner plan` and `runner run --engine fake --quiet` each in a process of its own, and
records peak RSS (that process's maximum resident set, through a launcher: see timed), rows per second of the whole
process, SQLite rows written per second of store time, the database size, and where the run's time
went (read, tokenize and build, check, store: the run loop's own timers). Prints a table; writes JSON.

Then `runner export` of the job in each format (--export), each row's raw output padded first.

    python bench/scale.py --rows 10000,100000,1000000 --out bench/results/DATE-cpu-scale.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the a of report vendor policy audit ledger customer incident region quarter contract renewal system "
         "error latency checkout payment refund shipment warehouse invoice account access review summary").split()


def write_input(path: Path, rows: int, prompts: int = 8, seed: int = 7) -> Path:
    """N rows in record batches (bounded memory here too): ids, ~60-word bodies, 8 long prompts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    systems = [f"You are extraction assistant #{i}. " + " ".join(rng.choice(WORDS) for _ in range(300))
               for i in range(prompts)]
    schema = pa.schema([("doc_id", pa.string()), ("body", pa.string()), ("system_prompt", pa.string())])
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, schema) as w:
        for start in range(0, rows, 50_000):
            n = min(50_000, rows - start)
            w.write_table(pa.table({
                "doc_id": [f"doc-{i:08d}" for i in range(start, start + n)],
                "body": [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n)],
                "system_prompt": [systems[rng.randrange(prompts)] for _ in range(n)],
            }, schema=schema))
    return path


def write_job(work: Path, parquet: Path, model: str) -> Path:
    import yaml

    (work / "schema.json").write_text(json.dumps({
        "type": "object", "required": ["summary", "sentiment"], "additionalProperties": False,
        "properties": {"summary": {"type": "string", "maxLength": 200},
                       "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]}}}))
    (work / "engine.yaml").write_text(yaml.safe_dump({"model": model, "max_model_len": 2048}))
    job = {"name": "scale", "input": {"path": str(parquet), "id_column": "doc_id", "text_column": "body",
                                      "system_prompt_column": "system_prompt"},
           "output_schema": "schema.json", "engine": {"config": "engine.yaml"},
           "sampling": {"max_tokens": 64}, "output": {"database": "results.sqlite", "commit_every_rows": 512}}
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    return work / "job.yaml"


# A child's peak RSS counts the pages it shares with its parent right after fork; this script
# grows while it writes the input, so a small launcher forks the command and reports that.
LAUNCHER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def timed(cmd: list[str]) -> dict:
    """Run cmd; its wall time and its own peak RSS (not this script's, nor other children's)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(int(proc.stdout.split()[-1]) / 1024, 1)}


def measure(rows: int, a) -> dict:
    import sqlite3

    work = Path(a.workdir) / f"n{rows}"
    work.mkdir(parents=True, exist_ok=True)
    parquet = work / "input.parquet"
    if not parquet.exists():
        write_input(parquet, rows)
    job = write_job(work, parquet, a.model)
    for f in work.glob("results.sqlite*"):
        f.unlink()
    runner = [sys.executable, "-m", "runner.cli"]
    plan = timed(runner + ["plan", str(job)])
    run = timed(runner + ["run", "--engine", "fake", "--quiet", str(job)])
    con = sqlite3.connect(work / "results.sqlite")
    stored, stats = con.execute("SELECT count(*) FROM results").fetchone()[0], \
        con.execute("SELECT wall_s, engine_choice_json FROM run_stats").fetchone()
    con.close()
    loop = json.loads(stats[1]).get("runner_loop", {})
    size = sum(f.stat().st_size for f in work.glob("results.sqlite*"))
    return {
        "rows": rows, "rows_stored": stored,
        "run": run | {"rows_per_s": round(rows / run["wall_s"], 1), "stored_wall_s": stats[0],
                      "sqlite_rows_per_s": round(rows / loop["store_s"], 1) if loop.get("store_s") else None,
                      "time_s": loop, "database_mb": round(size / 2**20, 1)},
        "plan": plan | {"rows_per_s": round(rows / plan["wall_s"], 1)},
        "export": export(work, job, a),
    }


def export(work: Path, job: Path, a) -> dict:
    """`runner export` of the whole job per format, after padding each row's raw output to
    --pad-output-chars (the fake engine's answers are ~60 characters; a model's run longer)."""
    import sqlite3

    if not a.export:
        return {}
    con = sqlite3.connect(work / "results.sqlite")
    con.execute("UPDATE results SET output_text = substr(output_text || printf('%.*c', ?, 'x'), 1, ?)",
                (a.pad_output_chars, a.pad_output_chars))
    con.commit()
    con.close()
    runner = [sys.executable, "-m", "runner.cli", "export", "--job", str(job)]
    return {fmt: timed(runner + ["--format", fmt, "-o", str(work / f"export.{fmt}")]) for fmt in a.export.split(",")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="10000,100000,1000000")
    ap.add_argument("--model", default=str(Path.home() / ".cache/runner/models/smollm2-135m-instruct"),
                    help="a model folder (only its tokenizer and chat template are used)")
    ap.add_argument("--workdir", default="/tmp/runner-scale")
    ap.add_argument("--out", default=None)
    ap.add_argument("--machine", default="this project's CPU machine (2 cores, 24 GiB)")
    ap.add_argument("--export", default="parquet,csv,jsonl", help="formats to export the job in (empty: none)")
    ap.add_argument("--pad-output-chars", type=int, default=2000, help="each row's raw output before the export")
    a = ap.parse_args()
    results = []
    for n in [int(x) for x in a.rows.split(",")]:
        r = measure(n, a)
        results.append(r)
        print(f"{n:>9,} rows: run {r['run']['wall_s']:>7.1f} s  {r['run']['rows_per_s']:>8,.0f} rows/s  "
              f"peak {r['run']['peak_rss_mb']:>6.0f} MB  db {r['run']['database_mb']:>6.0f} MB | "
              f"plan {r['plan']['wall_s']:>6.1f} s  peak {r['plan']['peak_rss_mb']:>6.0f} MB" +
              "".join(f" | export {fmt} {e['wall_s']:.1f} s peak {e['peak_rss_mb']:.0f} MB" for fmt, e in r["export"].items()),
              file=sys.stderr, flush=True)
    doc = {"machine": a.machine, "date": date.today().isoformat(), "results": results}
    print(json.dumps(doc, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
