"""Does a repetition penalty stop the embedded model from looping until max_tokens?

Runs a job (default: the sample job) once per penalty, each a `runner run` process on a fresh
database with `--set sampling.repetition_penalty=P`, and counts rows by status (greedy decoding:
the counts are deterministic; documents/s is a side note). Prints a table; writes JSON.

    python bench/penalty.py --penalties none,1.05,1.1,1.2 --out bench/results/DATE-cpu-penalty.json
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.speculation import runner  # noqa: E402  (one `runner ...` subprocess helper for the benches)


def run(job: Path, penalty: str, work: Path, as_retry: bool = False) -> dict:
    db = work / f"penalty-{penalty}.sqlite"
    for f in work.glob(f"penalty-{penalty}.sqlite*"):
        f.unlink()
    sets = ["--set", f"output.database={db}", "--set", "output.max_failed_fraction=1"]
    if penalty != "none":
        field = "retry_repetition_penalty" if as_retry else "repetition_penalty"
        sets += ["--set", f"sampling.{field}={penalty}"]
    t0 = time.perf_counter()
    runner("run", "--quiet", *sets, job)
    process_s = round(time.perf_counter() - t0, 1)
    con = sqlite3.connect(db)
    statuses = dict(con.execute("SELECT status, count(*) FROM results GROUP BY status"))
    stats = con.execute("SELECT documents_per_s, completion_tokens FROM run_stats").fetchone()
    retried = dict(con.execute("SELECT status, count(*) FROM results WHERE attempts > 1 GROUP BY status"))
    return {"repetition_penalty": penalty, "as_retry": as_retry, "statuses": statuses, "retried_rows_by_status": retried,
            "extractions": dict(con.execute("SELECT row_id, status || ' ' || coalesce(extraction_json, '') FROM results")),
            "process_s": process_s, "documents_per_s": stats[0], "completion_tokens": stats[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(ROOT / "jobs" / "summarize.yaml"))
    ap.add_argument("--penalties", default="none,1.05,1.1,1.2")
    ap.add_argument("--machine", default="this CPU machine")
    ap.add_argument("--as-retry", action="store_true",
                    help="set sampling.retry_repetition_penalty (a retry of rows cut off) instead of a penalty for every row")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="runner-penalty-"))
    runs = []
    for p in a.penalties.split(","):
        r = run(Path(a.job).resolve(), p, work, a.as_retry)
        runs.append(r)
        print(f"penalty {p:>5}: {r['statuses']}  {r['documents_per_s']:.2f} doc/s  {r['completion_tokens']} output tokens",
              file=sys.stderr, flush=True)
    base = runs[0]["extractions"]
    for r in runs:  # of the rows ok in this run and the first, the share with the same extraction
        mine = r.pop("extractions")
        both = [k for k, v in mine.items() if v.startswith("ok ") and base.get(k, "").startswith("ok ")]
        r["same_extraction_as_first_run"] = round(sum(mine[k] == base[k] for k in both) / max(len(both), 1), 4)
    doc = {"date": date.today().isoformat(), "machine": a.machine, "commit": os.environ.get("BENCH_COMMIT"),
           "job": a.job, "runs": runs}
    print(json.dumps(doc, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
