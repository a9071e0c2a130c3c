"""Throughput benchmark: plain vLLM against the runner, with ablations, in two KV-cache regimes.

Every configuration runs in its own process on the same model and the same synthetic workload
(bench/workload.py). Prints a table and writes JSON.

    python bench/bench.py --model /tmp/smollm2 --docs 1024 --prompts 64 --out bench/results/X.json
    python bench/bench.py --platform cpu --docs 48 --prompts 4 --prompt-words 150 --out /tmp/cpu.json

Configurations:
  plain        one LLM.generate over all prompts in arrival order, vLLM's defaults
  runner       the runner with its defaults (grouping, warm prefix, KV admission, speculative: auto)
  raw_ordered  one LLM.generate over the runner's order with the runner's chosen settings
  no_grouping  the runner in arrival order (plan window of 1 row), chosen speculation
  spec_off, spec_k2 .. spec_k6   the runner with a fixed speculative setting
  seqs_256     the runner with max_num_seqs=256 (concurrency), chosen speculation
  no_warm      the runner without prefix warming (a group's rows all sent at once), no speculation
  peaks_only   the runner admitting by the sum of peak KV needs only (no projection), no speculation
  ray          the runner through the ray executor (one replica on one GPU), no speculation;
               compare with spec_off (the local executor, same settings)
Regimes: roomy (vLLM's KV cache) and tight (num_gpu_blocks_override, like a 24 GB card running a
large model).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROOMY_FIRST = ["plain", "runner"]
AFTER_CHOICE = ["raw_ordered", "spec_off", "ray", "no_warm", "peaks_only", "no_grouping", "spec_k2", "spec_k4", "spec_k6",
                "spec_k3", "spec_k5", "seqs_256"]
NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def engine_config(a, regime: str) -> dict:
    """The runner's engine config for the platform and regime (the runner's defaults for it)."""
    cfg = {"model": a.model, "dtype": "bfloat16", "max_model_len": a.max_model_len, "enable_prefix_caching": True,
           "speculative": "auto", "calibration": {"rows": a.calibration_rows, "max_draft_tokens": 6}}
    if a.platform == "cpu":
        cfg |= {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "in_process": True, "block_size": 32,
                "max_num_seqs": 32}
    else:
        cfg |= {"max_num_seqs": 1024, "gpu_memory_utilization": 0.85}
    if regime == "tight":
        cfg["num_gpu_blocks_override"] = a.tight_blocks
    return cfg


def runner_variant(name: str, choice: int) -> tuple[dict, dict]:
    """(engine overrides, job overrides) for a runner configuration."""
    fixed = {"speculative": None if choice == 0 else NGRAM | {"num_speculative_tokens": choice}}
    if name == "runner":
        return {}, {}
    if name == "no_grouping":
        return fixed | {"warm_prefix": False}, {"plan_window_rows": 1}
    if name == "seqs_256":
        return fixed | {"max_num_seqs": 256}, {}
    if name == "spec_off":
        return {"speculative": None}, {}
    if name == "no_warm":
        return {"speculative": None, "warm_prefix": False}, {}
    if name == "peaks_only":
        return {"speculative": None, "kv_projection": False}, {}
    if name == "ray":
        return {"speculative": None}, {"executor": "ray", "ray": {"replicas": 1, "gpus_per_replica": 1}}
    if name.startswith("spec_k"):
        return {"speculative": NGRAM | {"num_speculative_tokens": int(name[6:])}}, {}
    raise ValueError(name)


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, kids) / 1024, 1)


def child_runner(a, name: str, regime: str, choice: int) -> dict:
    import yaml

    from runner.run import run_job
    from runner.spec import load_job

    work = Path(a.workdir) / f"{regime}-{name}"
    work.mkdir(parents=True, exist_ok=True)
    eng_over, job_over = runner_variant(name, choice)
    if "ray" in job_over and a.platform == "cpu":  # CPU-only replica; Ray's read tasks need CPUs beside it
        job_over["ray"] |= {"gpus_per_replica": 0, "local_num_cpus": 4}
    (work / "engine.yaml").write_text(yaml.safe_dump(engine_config(a, regime) | eng_over))
    job = {"name": "bench", "input": {"path": str(Path(a.workdir) / "documents.parquet"), "id_column": "doc_id",
                                      "text_column": "text", "system_prompt_column": "system_prompt"},
           "output_schema": str(Path(a.workdir) / "schema.json"), "engine": {"config": "engine.yaml"},
           "sampling": {"temperature": 0, "max_tokens": a.max_tokens, "seed": 0},
           "output": {"database": "results.sqlite", "commit_every_rows": 256}} | job_over
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    (work / "results.sqlite").unlink(missing_ok=True)
    t0 = time.perf_counter()
    if os.environ.get("BENCH_PROFILE") == name:  # where the driver's time goes, for the streaming overhead
        import cProfile
        import pstats

        prof = cProfile.Profile()
        s = prof.runcall(run_job, load_job(work / "job.yaml")).stats
        with open(Path(a.workdir) / f"profile-{regime}-{name}.txt", "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(60)
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
    else:
        s = run_job(load_job(work / "job.yaml")).stats
    choice_json = json.loads(s["engine_choice_json"])
    cal = choice_json.get("speculative_calibration")
    return {
        "documents_per_s": s["documents_per_s"], "output_tokens_per_s": s["output_tokens_per_s"],
        "prefix_cache_hit_rate": s["prefix_cache_hit_rate"], "plan_prefix_share": s["plan_prefix_share"],
        "spec_acceptance_rate": s["spec_acceptance_rate"], "preemptions": s["preemptions"],
        "rows_ok": s["rows_ok"], "rows": s["rows_total"], "generation_s": s["generation_s"],
        "engine_load_s": s["engine_load_s"], "wall_s": round(time.perf_counter() - t0, 2),
        "chosen_draft_tokens": cal["chosen_draft_tokens"] if cal else None, "calibration": cal,
        "kv_admission": [{k: v for k, v in e.items() if k != "settings"} for e in choice_json["engines"]],
    }


def child_plain(a, name: str, regime: str, choice: int) -> dict:
    """Plain vLLM: one LLM.generate. `plain`: arrival order, vLLM's defaults; `raw_ordered`: the runner's
    order and settings, for the streaming-overhead comparison."""
    from runner.engines.vllm_settings import llm_kwargs, offline_environment
    from runner.inputs import iter_documents
    from runner.plan import plan_stream
    from runner.prompting import PromptBuilder
    from runner.engine_config import EngineConfig
    from runner.spec import InputSpec

    cfg = EngineConfig(**(engine_config(a, regime) | runner_variant("spec_off" if choice == 0 else f"spec_k{choice}", 0)[0]))
    os.environ.update(offline_environment(cfg.in_process if name == "raw_ordered" else False))
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    spec = InputSpec(path="x", id_column="doc_id", text_column="text", system_prompt_column="system_prompt")
    docs = list(iter_documents(str(Path(a.workdir) / "documents.parquet"), spec, None))
    builder = PromptBuilder(Path(a.model))
    if name == "raw_ordered":
        docs = [d for g in plan_stream(docs, 8192) for d in g.docs]
        kw = llm_kwargs(cfg, Path(a.model), 0)
        so = StructuredOutputsParams(json=json.loads((Path(a.workdir) / "schema.json").read_text()),
                                     disable_any_whitespace=True)
    else:
        kw = {"model": a.model, "dtype": "bfloat16", "max_model_len": a.max_model_len, "disable_log_stats": False}
        if a.platform == "cpu":  # the CPU engine needs a KV cap and eager mode to start in reasonable time
            kw |= {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "block_size": 32}  # same KV tokens as the runner
        if regime == "tight":
            kw["num_gpu_blocks_override"] = a.tight_blocks
        so = StructuredOutputsParams(json=json.loads((Path(a.workdir) / "schema.json").read_text()))
    prompts = [{"prompt_token_ids": ids} for ids in
               builder.encode_batch([builder.render(d.system_prompt, d.text) for d in docs])]
    t_load = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t_load
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, seed=0, structured_outputs=so)
    before = _metrics(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    m = {k: v - before.get(k, 0) for k, v in _metrics(llm).items()}
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ok = sum(_valid(o.outputs[0].text) for o in outs)
    return {
        "documents_per_s": len(outs) / gen_s, "output_tokens_per_s": out_tokens / gen_s,
        "prefix_cache_hit_rate": _div(m.get("vllm:prefix_cache_hits", 0), m.get("vllm:prefix_cache_queries", 0)),
        "spec_acceptance_rate": _div(m.get("vllm:spec_decode_num_accepted_tokens", 0), m.get("vllm:spec_decode_num_draft_tokens", 0)),
        "preemptions": m.get("vllm:num_preemptions", 0), "rows_ok": ok, "rows": len(outs),
        "generation_s": round(gen_s, 3), "engine_load_s": round(load_s, 2), "settings": {k: v for k, v in kw.items() if k != "model"},
    }


def _valid(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _div(a, b):
    return a / b if b else None


def _metrics(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        v = getattr(m, "value", None)
        if isinstance(v, (int, float)):
            out[m.name] = out.get(m.name, 0) + v
    return out


def run_child(a, name: str, regime: str, choice: int) -> dict:
    """Run one configuration in a fresh process; return its result (or its error)."""
    cmd = [sys.executable, __file__, "--child", name, "--regime", regime, "--choice", str(choice)] + a.passthrough
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.child_timeout)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        return {"error": (proc.stderr or proc.stdout)[-1500:], "process_s": round(time.perf_counter() - t0, 1)}
    return json.loads(line[-1][7:]) | {"process_s": round(time.perf_counter() - t0, 1)}


def table(results: dict) -> str:
    head = f"{'regime':<6} {'config':<12} {'docs/s':>8} {'out tok/s':>10} {'hit rate':>8} {'accept':>7} {'preempt':>7} {'rss MB':>7} {'ok':>6}"
    lines = [head, "-" * len(head)]
    for regime, configs in results.items():
        for name, r in configs.items():
            if "error" in r:
                lines.append(f"{regime:<6} {name:<12} ERROR {r['error'].strip().splitlines()[-1][:80] if r['error'].strip() else ''}")
                continue
            pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"
            lines.append(f"{regime:<6} {name:<12} {r['documents_per_s']:>8.2f} {r['output_tokens_per_s']:>10.1f} "
                         f"{pct(r['prefix_cache_hit_rate']):>8} {pct(r['spec_acceptance_rate']):>7} {r['preemptions']:>7} "
                         f"{r.get('peak_rss_mb', 0):>7.0f} {r['rows_ok']:>3}/{r['rows']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--platform", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--docs", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=650, help="words per system prompt (~1.4 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--tight-blocks", type=int, default=1024, help="KV blocks in the tight regime")
    ap.add_argument("--calibration-rows", type=int, default=64)
    ap.add_argument("--regimes", default="tight,roomy")
    ap.add_argument("--configs", default=",".join(ROOMY_FIRST + AFTER_CHOICE), help="comma-separated subset")
    ap.add_argument("--tight-configs", default="plain,runner,no_grouping")
    ap.add_argument("--workdir", default="/tmp/runner-bench")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--child-timeout", type=int, default=900)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--regime", default="roomy", help=argparse.SUPPRESS)
    ap.add_argument("--choice", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.passthrough = ["--model", a.model, "--platform", a.platform, "--max-tokens", str(a.max_tokens),
                     "--max-model-len", str(a.max_model_len), "--tight-blocks", str(a.tight_blocks),
                     "--calibration-rows", str(a.calibration_rows), "--workdir", a.workdir]
    if a.child:
        fn = child_plain if a.child in ("plain", "raw_ordered") else child_runner
        result = fn(a, a.child, a.regime, a.choice) | {"peak_rss_mb": peak_rss_mb()}
        print("RESULT " + json.dumps(result, default=str), flush=True)
        return

    from bench.workload import write_workload

    write_workload(Path(a.workdir), a.docs, a.prompts, a.prompt_words)
    results: dict = {}
    for regime in a.regimes.split(","):
        wanted = (a.tight_configs if regime == "tight" else a.configs).split(",")
        results[regime] = {}
        choice = 0
        # In the order asked for, but `runner` before the configurations that reuse its choice.
        order = sorted(wanted, key=lambda n: (n in ("raw_ordered", "no_grouping", "seqs_256"), wanted.index(n)))
        for name in [n for n in order if n in ROOMY_FIRST + AFTER_CHOICE]:
            r = run_child(a, name, regime, choice)
            results[regime][name] = r
            if name == "runner" and r.get("chosen_draft_tokens") is not None:
                choice = r["chosen_draft_tokens"]
            print(f"{regime} {name}: " + (f"{r['documents_per_s']:.2f} docs/s" if "error" not in r else "ERROR"),
                  file=sys.stderr, flush=True)
            save(a, results)  # after every configuration: a cut-short session keeps what it measured
    print(table(results))
    print(json.dumps(summarize(results), indent=1))


def save(a, results: dict) -> None:
    if not a.out:
        return
    doc = {"machine": a.machine or a.platform, "date": date.today().isoformat(), **summarize(results),
           "workload": {"docs": a.docs, "prompts": a.prompts, "prompt_words": a.prompt_words,
                        "max_tokens": a.max_tokens, "tight_blocks": a.tight_blocks},
           "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1, default=str))


def summarize(results: dict) -> dict:
    """Speedups of the runner over plain vLLM, the streaming overhead, and the speculation choice."""
    def dps(regime, name):
        r = results.get(regime, {}).get(name, {})
        return r.get("documents_per_s") if "error" not in r else None

    out = {}
    for regime in ("tight", "roomy"):
        a, b = dps(regime, "plain"), dps(regime, "runner")
        out[f"{regime}_speedup"] = round(b / a, 3) if a and b else None
    roomy = results.get("roomy", {})
    choice = roomy.get("runner", {}).get("chosen_draft_tokens")
    fixed = {n: dps("roomy", n) for n in ["spec_off", "spec_k2", "spec_k3", "spec_k4", "spec_k5", "spec_k6"]}
    fixed = {n: v for n, v in fixed.items() if v}
    if fixed and choice is not None:
        chosen_name = "spec_off" if choice == 0 else f"spec_k{choice}"
        best = max(fixed, key=fixed.get)
        out["speculation"] = {"chosen": chosen_name, "best_fixed": best,
                              "chosen_vs_best": round(fixed.get(chosen_name, 0) / fixed[best], 3)}
        raw = dps("roomy", "raw_ordered")
        if raw and fixed.get(chosen_name):
            out["runner_vs_raw_ordered"] = round(fixed[chosen_name] / raw, 3)
    return out


if __name__ == "__main__":
    main()
