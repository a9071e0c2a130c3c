"""Engine start: `runner run` against plain `LLM(...)` with the same settings plus one request.

Both are whole processes on the job's engine config, timed from start to exit, interleaved in
rounds: `plain` imports vLLM, builds `LLM(**settings)` (the keyword arguments the runner itself
would pass) and generates one token for the job's first row (its prompt as the runner builds it,
under the job's schema); `runner` is `runner run --limit 1` with `max_tokens` 1 on a
fresh database (reading, planning, the lock and the database included). What the runner adds to
starting an engine is the difference. Prints a table; writes JSON with every run.

    python bench/startup.py --job jobs/summarize.yaml --out bench/results/DATE-MACHINE-startup.json
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import install_handlers, run_group  # noqa: E402
from bench.speculation import runner  # noqa: E402  (the benches' one `runner ...` subprocess helper)

PLAIN = """
import json, os, sys, time
t0 = time.perf_counter()
kw = json.load(open(sys.argv[1]))
first = json.load(open(sys.argv[3]))
os.environ.update(json.load(open(sys.argv[2])))
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
t1 = time.perf_counter()
llm = LLM(**kw)
t2 = time.perf_counter()
params = SamplingParams(max_tokens=1, temperature=0, structured_outputs=StructuredOutputsParams(json=first["schema"]))
llm.generate([{"prompt_token_ids": first["prompt_token_ids"]}], params, use_tqdm=False)
t3 = time.perf_counter()
# As the runner does: stop the engine core (a separate process on a GPU: left running, it would
# hold the GPU and this script's output pipes), then exit without tearing torch and vLLM down.
shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
if callable(shutdown):
    shutdown()
t4 = time.perf_counter()
print("RESULT " + json.dumps({"import_s": t1 - t0, "init_s": t2 - t1, "request_s": t3 - t2, "shutdown_s": t4 - t3}),
      flush=True)
os._exit(0)
"""


def settings(job_path: str, work: Path) -> list[Path]:
    """For the plain child: the runner's own vLLM keyword arguments and environment for the job,
    and the job's first row as the runner prompts it (token ids) with the job's schema."""
    from runner.engines.vllm_settings import llm_kwargs, offline_environment, resolve_grammar
    from runner.prompting import builder_for
    from runner.readers import LocalReader
    from runner.spec import load_job

    job = load_job(job_path)
    engine, _ = resolve_grammar(job.engine, job.model_path, job.output_schema)  # the runner's backend (cached)
    kw, env = llm_kwargs(engine, job.model_path, job.spec.sampling.seed), offline_environment(job.engine.in_process)
    doc = next(iter(LocalReader(job.input_path, job.spec.input).documents(job.system_source)))
    builder = builder_for(job)
    first = {"prompt_token_ids": builder.prompt_ids(doc.system_prompt, builder.user_text(doc)),
             "schema": job.output_schema}
    paths = [work / "kw.json", work / "env.json", work / "first.json"]
    for path, value in zip(paths, (kw, env, first)):
        path.write_text(json.dumps(value))
    return paths


def run_plain(files: list[Path]) -> dict:
    t0 = time.perf_counter()
    proc = run_group([sys.executable, "-c", PLAIN, *map(str, files)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)
    process_s = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"config": "plain", "error": proc.stderr[-1500:], "process_s": process_s}
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return {"config": "plain", "process_s": process_s} | json.loads(line[7:])


def run_runner(job: str, work: Path, n: int) -> dict:
    db = work / f"runner-{n}.sqlite"
    t0 = time.perf_counter()
    proc = runner("run", "--quiet", "--limit", "1", "--set", "sampling.max_tokens=1",
                  "--set", "sampling.retry_repetition_penalty=null", "--set", f"output.database={db}", job, check=False)
    process_s = time.perf_counter() - t0
    if proc.returncode not in (0, 65):  # 65: the one-token row is cut off, which is the point
        return {"config": "runner", "error": proc.stderr[-1500:], "process_s": process_s}
    con = sqlite3.connect(db)
    load, gen, wall = con.execute("SELECT engine_load_s, generation_s, wall_s FROM run_stats").fetchone()
    con.close()
    return {"config": "runner", "process_s": process_s, "engine_load_s": load, "generation_s": gen, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(ROOT / "jobs" / "summarize.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--machine", default="this machine")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    install_handlers()
    work = Path(tempfile.mkdtemp(prefix="runner-startup-"))
    files = settings(a.job, work)
    runs = []
    for r in range(1, a.repeats + 1):
        for config in ("plain", "runner"):
            run = run_plain(files) if config == "plain" else run_runner(a.job, work, r)
            runs.append(run | {"round": r})
            print(f"round {r} {config}: {run['process_s']:.1f} s{' ERROR ' + run['error'] if 'error' in run else ''}",
                  file=sys.stderr, flush=True)
    ok = [x for x in runs if "error" not in x]

    def med(config: str, key: str):
        values = [x[key] for x in ok if x["config"] == config and x.get(key) is not None]
        return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
                "max": round(max(values), 2)} if values else None

    ratios = [next(x for x in ok if x["config"] == "runner" and x["round"] == r)["process_s"]
              / next(x for x in ok if x["config"] == "plain" and x["round"] == r)["process_s"]
              for r in range(1, a.repeats + 1)
              if {"plain", "runner"} <= {x["config"] for x in ok if x["round"] == r}]
    summary = {"plain_process_s": med("plain", "process_s"), "plain_import_s": med("plain", "import_s"),
               "plain_init_s": med("plain", "init_s"), "runner_process_s": med("runner", "process_s"),
               "runner_engine_load_s": med("runner", "engine_load_s"),
               "runner_vs_plain_process": round(statistics.median(ratios), 3) if ratios else None}
    print(f"{'':<10}{'process s (median, min-max)':>30}")
    for config in ("plain", "runner"):
        m = summary[f"{config}_process_s"]
        print(f"{config:<10}{m['median']:>12} ({m['min']}-{m['max']})" if m else f"{config:<10} failed")
    print(json.dumps(summary))
    if a.out:
        doc = {"machine": a.machine, "date": date.today().isoformat(), "commit": os.environ.get("BENCH_COMMIT"),
               "job": a.job, "settings": json.loads(files[0].read_text()), **summary, "runs": runs}
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
