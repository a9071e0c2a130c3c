"""The benchmark's runs: what each one executes, where, and how its result is read back.

A Task is one process: the plain-vLLM script or `runner run`; bench/schedule.py runs them on free
GPUs.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from bench import caches
from bench.procs import run_group
from bench.variants import ROOT, VARIANT_ENV, engine_settings, graph_sizes, runner_variant
from runner.errors import SpecError

# vLLM's periodic stats line (every 5 s while it generates): requests running and KV-cache usage
STATS_LOG = re.compile(r"Running: (\d+) reqs.*?KV cache usage: ([\d.]+)%")
STARTUP_LOG = re.compile(r"took|seconds|secs|torch\.compile|Graph captur|Loading weights|Memory profiling|KV cache|maximum concurrency", re.I)


@dataclass
class Task:
    case: str  # WORKLOAD/REGIME/MODEL
    config: str
    round: int
    gpus: int = 1
    result: Optional[dict] = None
    gpu_ids: str = ""
    started_s: Optional[float] = None

    @property
    def alone(self) -> bool:
        """Runs with no neighbour on the machine: `ray1` against `ray2` is the comparison."""
        return self.config.startswith("ray")

    @property
    def workload(self) -> str:
        return self.case.split("/")[0]

    @property
    def regime(self) -> str:
        return self.case.split("/")[1]

    @property
    def model(self) -> str:
        return self.case.split("/")[2]

    @property
    def compile_key(self) -> tuple:
        """Runs that share vLLM's compiled graphs: the CUDA graph sizes are part of vLLM's compile
        hash (plain vLLM runs its own list; the runner the GPU config's, unless its variant names one;
        a speculative config is in the hash too, which spec_k* do not count). Variants that do not
        compile (nocompile_dec, breakable) share their sizes' key: they only wait for those first
        compiles when several GPUs start at once."""
        return (self.model, str(graph_sizes(self.config)), self.gpus)

    def record(self) -> dict:
        return {"case": self.case, "config": self.config, "round": self.round, "gpus": self.gpu_ids,
                "started_s": self.started_s, **(self.result or {})}


def parse_cases(text: str) -> list[tuple[str, list[str], Optional[int]]]:
    """`CASE=CONFIGS[@REPEATS];...`: REPEATS caps that case's rounds; KeyError for another shape."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        case, eq, rest = part.partition("=")
        configs, _, cap = rest.partition("@")
        if not eq or not configs or cap and not cap.isdigit():
            raise KeyError(f"cases {part!r}: expected WORKLOAD/REGIME/MODEL=CONFIG,CONFIG[@REPEATS]")
        out.append((case, configs.split(","), int(cap) if cap else None))
    return out


def check_case(case: str) -> None:
    """WORKLOAD/REGIME/MODEL with known parts, or KeyError naming the case."""
    from bench.models import SHAPES
    from bench.workload import WORKLOADS

    parts = case.split("/")
    if len(parts) != 3 or parts[0] not in WORKLOADS or parts[1] not in ("tight", "roomy") or \
            parts[2] not in {"135m", *SHAPES}:
        raise KeyError(f"case {case!r}: expected WORKLOAD/REGIME/MODEL with WORKLOAD in {sorted(WORKLOADS)}, "
                       f"REGIME tight or roomy, MODEL 135m or one of {sorted(SHAPES)}")


def make_tasks(a) -> list[Task]:
    """Round by round: every single-GPU case, then the multi-GPU ones, so that a deadline cuts the
    last rounds rather than a whole comparison. Each round starts a case one configuration later
    than the round before, so that no configuration always runs right after the same one."""
    for case, configs, _ in parse_cases(a.cases) + parse_cases(a.multi):
        check_case(case)  # a misspelt case or configuration stops here, before any GPU time is spent
        for c in (c for c in configs if c not in ("plain", "sorted")):
            try:
                graph_sizes(c)  # the variant's settings over the GPU config, as the runner validates them
            except (KeyError, ValueError):  # ValueError: vq/spec_k without a number
                raise KeyError(f"configuration {c!r}: neither plain, sorted nor one of bench/variants.py's") from None
            except SpecError as exc:
                raise KeyError(f"configuration {c!r}: the runner refuses its settings: {exc}") from None
    tasks = []
    for r in range(1, max(a.repeats, a.multi_repeats) + 1):
        for case, configs, cap in parse_cases(a.cases):
            if r <= min(cap or a.repeats, a.repeats):
                turn = (r - 1) % len(configs)
                tasks += [Task(case, c, r) for c in configs[turn:] + configs[:turn]]
        for case, configs, cap in parse_cases(a.multi):
            if r <= min(cap or a.multi_repeats, a.multi_repeats):
                tasks += [Task(case, c, r, gpus=2 if c.startswith("ray2") else 1) for c in configs]
    return tasks


# -- what a task runs -------------------------------------------------------------------------
def workload_dir(a, t: Task) -> Path:
    """Documents and schema of the task's workload, written once."""
    from bench.workload import WORKLOADS, write_workload

    docs = a.multi_docs if t.config.startswith("ray") else a.docs
    d = Path(a.workdir) / f"{t.workload}-{docs}"
    if not (d / "documents.parquet").is_file():
        _, _, _, prompts, words, _ = WORKLOADS[t.workload]
        write_workload(d, docs, prompts, words, kind=t.workload)
    return d


def model_dir(a, t: Task) -> Path:
    """The task's model folder: the 135M's, or a config-only one of the 8B shape, written once
    beside the 135M's, not in the workdir: vLLM's compile-cache key holds the model's path, so a
    warm-up in another workdir warmed nothing for the 8B (the lease of 04253d4: every round-1 run
    compiled again, ~24 s)."""
    if t.model == "135m":
        return Path(a.model)
    from bench.models import write_dummy_model

    d = Path(a.model).parent / f"{Path(a.model).name}-dummy-{t.model}"
    if not (d / "config.json").is_file():
        write_dummy_model(Path(a.model), d, t.model)
    return d


def max_tokens(t: Task) -> int:
    """Output tokens a row may take: the workload's, 256 for the 8B shape."""
    from bench.workload import WORKLOADS

    return 256 if t.model == "8b" else WORKLOADS[t.workload][5]


def tight_blocks(a, t: Task) -> Optional[int]:
    """KV blocks of the tight regime for the task's model; None in the roomy one (vLLM's own)."""
    if t.regime != "tight":
        return None
    return a.tight_blocks_8b if t.model == "8b" else a.tight_blocks


def task_dir(a, t: Task) -> Path:
    """An empty folder for the task's files (job, database, logs)."""
    d = Path(a.workdir) / "runs" / f"{t.case.replace('/', '-')}-{t.config}-r{t.round}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def plain_command(a, t: Task, d: Path) -> list[str]:
    """The plain-vLLM script's command line (arrival order, or sorted by system prompt)."""
    w = workload_dir(a, t)
    cmd = [sys.executable, str(ROOT / "bench" / "plain_vllm.py"), "--model", str(model_dir(a, t)),
           "--input", str(w / "documents.parquet"), "--schema", str(w / "schema.json"),
           "--max-tokens", str(max_tokens(t)), "--out", str(d / "out.jsonl")]
    if t.config == "sorted":
        cmd.append("--sorted")
    if tight_blocks(a, t):
        cmd += ["--num-gpu-blocks", str(tight_blocks(a, t))]
    if t.model != "135m":
        cmd += ["--load-format", "dummy"]
    if a.platform == "cpu":
        cmd.append("--cpu")
    return cmd


def reuses_first_run(t: Task) -> bool:
    """A runner configuration that starts from the calibration its case's first run stored."""
    return t.config not in ("runner_first", "plain", "sorted")


def runner_command(a, t: Task, d: Path, seeds: dict) -> list[str]:
    """`runner run` on a job written for the task, with its configuration's settings (and the
    calibration its case stored, for the configurations that reuse it)."""
    w = workload_dir(a, t)
    engine, job_over = runner_variant(t.config)
    config = ROOT / "configs" / ("smollm2-cpu.yaml" if a.platform == "cpu" else "smollm2-h200.yaml")
    engine = {"config": str(config), "model": str(model_dir(a, t))} | engine | engine_settings(a)
    if tight_blocks(a, t):
        engine["num_gpu_blocks_override"] = tight_blocks(a, t)
    if t.model != "135m":
        engine["load_format"] = "dummy"
    if a.platform == "cpu" and t.config.startswith("ray"):  # CPU-only replicas; Ray's readers need CPUs
        job_over["ray"] |= {"gpus_per_replica": 0, "local_num_cpus": 4}
    job = {"name": "bench", "input": {"path": str(w / "documents.parquet"), "id_column": "doc_id",
                                      "text_column": "text", "system_prompt_column": "system_prompt"},
           "output_schema": str(w / "schema.json"), "engine": engine,
           "sampling": {"temperature": 0, "max_tokens": max_tokens(t), "seed": 0},
           # Speed is measured whatever share of rows the model gets right (rows_valid records it).
           "output": {"database": "results.sqlite", "commit_every_rows": 256, "max_failed_fraction": 1.0}} | job_over
    (d / "job.yaml").write_text(yaml.safe_dump(job))
    # The calibration a first run of this case stored, and this configuration's own where its
    # calibration key differs (its graph sizes are in the key) and an earlier round stored it.
    seed = seeds.get((t.case, t.config)) or seeds.get(t.case)
    if reuses_first_run(t) and seed:
        shutil.copy(seed, d / "results.sqlite")
    return [sys.executable, "-m", "runner.cli", "run", "--quiet", str(d / "job.yaml")]


def runner_result(d: Path) -> dict:
    """What a runner run measured, from its job's database (run_stats and results)."""
    con = sqlite3.connect(d / "results.sqlite")
    con.row_factory = sqlite3.Row
    s = dict(con.execute("SELECT * FROM run_stats ORDER BY run_id DESC LIMIT 1").fetchone())
    choice = json.loads(s.pop("engine_choice_json") or "{}")
    valid = con.execute("SELECT count(*) FROM results WHERE status = 'ok'").fetchone()[0]
    # vLLM's reasons (an `error` is a token the grammar forbade): a faster setting must not change them
    finish = dict(con.execute("SELECT coalesce(finish_reason, 'none'), count(*) FROM results GROUP BY 1").fetchall())
    con.close()
    return {k: s[k] for k in ("documents_per_s", "generation_s", "engine_load_s", "wall_s", "prefix_cache_hit_rate",
                              "plan_prefix_share", "preemptions", "spec_acceptance_rate", "completion_tokens")} | {
        "rows": s["rows_total"], "rows_valid": valid, "finish_reasons": finish,
        "calibration": choice.get("speculative_calibration"),
        "engine_starts_s": choice.get("engine_starts_s"), "grammar": choice.get("grammar"),  # measured or cached
        # the process's time before the run (Python, imports, input scan, the grammar measurement)
        # and the driver's own (reading, tokenizing, checking, storing): where "own work" goes
        "before_run_s": choice.get("before_run_s"), "runner_loop": choice.get("runner_loop"),
        "engines": [{k: v for k, v in e.items() if k != "settings"} for e in choice.get("engines", [])],
        # one hash of each engine's vLLM settings: runs whose starts differ may differ in settings
        "settings_sha": [hashlib.sha256(json.dumps(e.get("settings"), sort_keys=True, default=str).encode()).hexdigest()[:12]
                         for e in choice.get("engines", [])]}


def log_samples(log: str) -> dict:
    """vLLM's own periodic samples of a run, read from its log the same way for every configuration
    (plain vLLM reports nothing else while it generates): requests running and KV-cache usage (0-1)."""
    found = [(int(n), float(u) / 100) for n, u in STATS_LOG.findall(log)]
    return {"vllm_log_running": [n for n, _ in found], "vllm_log_kv_usage": [u for _, u in found]}


def make_seed(d: Path, seed: Path) -> None:
    """A database holding only what a first run stored for later runs: its calibrations. Written
    beside, then renamed: another run's thread may be copying the seed it replaces."""
    part = seed.with_name(f"{seed.name}.{threading.get_ident()}.part")
    shutil.copy(d / "results.sqlite", part)
    con = sqlite3.connect(part)
    for table in ("results", "run_samples", "run_stats", "runs"):
        con.execute(f"DELETE FROM {table}")
    con.commit()
    con.close()
    part.replace(seed)


def remember_seed(a, t: Task, result: dict, d: Path, seeds: dict) -> None:
    """Keep the calibration a run stored for the later rounds: a case's first run's, and that of a
    configuration whose calibration key differs from it (its engine settings are in the key), which
    calibrated anew from the first run's seed. Each is kept once."""
    if t.config == "runner_first":
        key = t.case
    elif reuses_first_run(t) and (result.get("calibration") or {}).get("calibration_id") and t.case in seeds:
        key = (t.case, t.config)
    else:
        return
    if key not in seeds:
        name = t.case.replace("/", "-") + ("" if key == t.case else f"-{t.config}")
        seed = Path(a.workdir) / f"seed-{name}.sqlite"
        make_seed(d, seed)
        seeds[key] = seed


def execute(a, t: Task, seeds: dict, env: dict) -> dict:
    """Run the task's process and return its record: the result, vLLM's log samples, the process
    time; or the error and the log's tail."""
    d = task_dir(a, t)
    plain = t.config in ("plain", "sorted")
    cmd = plain_command(a, t, d) if plain else runner_command(a, t, d, seeds)
    t0 = time.perf_counter()
    env = env | VARIANT_ENV.get(t.config, {})
    cached = caches.snapshot()
    with open(d / "stderr.log", "w") as err:
        proc = run_group(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(ROOT), env=env,
                         timeout=a.task_timeout)
    process_s = time.perf_counter() - t0
    cache_files = caches.added(cached, caches.snapshot())  # what this run built that a later one finds
    (d / "stdout.log").write_text(proc.stdout)
    log = proc.stdout + (d / "stderr.log").read_text(errors="replace")  # vLLM logs to stdout
    job_log = d / "results.sqlite.bench.log"  # the runner sends the engine's output to the job's log
    if job_log.exists():
        log += job_log.read_text(errors="replace")
    startup = [ln.strip()[-160:] for ln in log.splitlines() if STARTUP_LOG.search(ln)][:20]
    if proc.returncode != 0:
        return {"error": log[-2000:], "rc": proc.returncode, "process_s": round(process_s, 2),
                "cache_files_added": cache_files}
    if plain:
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        r = json.loads(line[7:])
    else:
        r = runner_result(d)
        remember_seed(a, t, r, d, seeds)
    return r | log_samples(log) | {"process_s": round(process_s, 2), "wall_documents_per_s": r["rows"] / process_s,
                                   "startup_log": startup, "cache_files_added": cache_files}
