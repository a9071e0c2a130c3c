"""What one engine step costs: a fixed part and a part per running request (plain vLLM, one process).

Admission and ordering win generation time only through the number of engine steps: if a step's
time is f + p x (requests running), packing more requests into fewer steps saves f a step and
nothing of p. This measures f and p on the GPU: batches of N rows of the invoices workload (grouped
by system prompt, as the runner sends them; their prompts cached by a 1-token pass first) decode
`--tokens` tokens each, all together, with the benchmark's schema (`json`: the token masks and the
grammar included; with random weights every output runs to the end) and as free text of the same
length (`text`: ignore_eos), and as free text without the system prompt (`short`: ~170 prompt
tokens a row instead of ~1,300: what reading each request's context costs). ms a step = time / vLLM's own step count; fitted by least squares on N.
The engine settings are the runner's GPU config's (CUDA graph sizes, compact JSON, xgrammar).

    python bench/step_cost.py --model /tmp/smollm2 --shape 8b --out step_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512]


def fit(points: list[tuple[int, float]]) -> dict:
    """Least squares ms = f + p x N over (N, ms) points: f in ms, p in µs a request."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    p = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    resid = [y - (my - p * mx) - p * x for x, y in points]
    return {"fixed_ms": round(my - p * mx, 3), "per_request_us": round(p * 1e3, 2),
            "max_residual_ms": round(max(abs(r) for r in resid), 3), "points": n}


def steps_count(llm) -> int:
    for m in llm.get_metrics():
        if m.name == "vllm:iteration_tokens_total" and isinstance(getattr(m, "count", None), int):
            return m.count
    raise RuntimeError("vLLM reported no step count (vllm:iteration_tokens_total)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the 135M model folder (the 8B shape takes its tokenizer)")
    ap.add_argument("--shape", default="8b", choices=["8b", "135m"])
    ap.add_argument("--batches", default="16,32,64,96,128,160,192")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="json,text,short")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="a smoke test on the CPU build (its KV cap, eager)")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from bench.models import write_dummy_model
    from bench.workload import write_workload

    work = Path(tempfile.mkdtemp(prefix="step-cost-"))
    model = a.model if a.shape == "135m" else str(write_dummy_model(Path(a.model), work / "model", a.shape))
    path = write_workload(work / "w", 1024, 64, 650)
    rows = sorted(pq.read_table(path).to_pylist(), key=lambda r: r["system_prompt"])
    schema = json.loads((path.parent / "schema.json").read_text())
    chats = [[{"role": "system", "content": r["system_prompt"]}, {"role": "user", "content": r["text"]}] for r in rows]
    shorts = [[{"role": "user", "content": r["text"]}] for r in rows]
    batches = [int(x) for x in a.batches.split(",")]
    kw = dict(model=model, max_model_len=4096, disable_log_stats=False, enable_prefix_caching=True,
              max_num_seqs=max(batches), structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    kw |= {"load_format": "dummy"} if a.shape != "135m" else {}
    kw |= ({"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "block_size": 32} if a.cpu else
           {"gpu_memory_utilization": 0.85, "compilation_config": {"cudagraph_capture_sizes": GRAPH_SIZES}})
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    params = {"json": SamplingParams(temperature=0, max_tokens=a.tokens, structured_outputs=StructuredOutputsParams(json=schema)),
              "text": SamplingParams(temperature=0, max_tokens=a.tokens, min_tokens=a.tokens, ignore_eos=True)}
    params["short"] = params["text"]
    llm.chat(chats[:max(batches)], SamplingParams(max_tokens=1), use_tqdm=False)  # prompts cached
    llm.chat(shorts[:max(batches)], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.chat(chats[:2], params["json"], use_tqdm=False)  # the grammar compiled
    modes = a.modes.split(",")
    runs = []
    for rep in range(a.repeats):
        order = batches[rep % len(batches):] + batches[:rep % len(batches)]  # each repeat starts elsewhere
        for n in order:
            for mode in modes:
                s0, t = steps_count(llm), time.perf_counter()
                outs = llm.chat((shorts if mode == "short" else chats)[:n], params[mode], use_tqdm=False)
                dt, steps = time.perf_counter() - t, steps_count(llm) - s0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                runs.append({"repeat": rep, "batch": n, "mode": mode, "seconds": round(dt, 4), "steps": steps,
                             "output_tokens": tokens, "ms_per_step": round(dt / max(steps, 1) * 1e3, 3),
                             "mean_running": round(tokens / max(steps, 1), 1)})
                print(json.dumps(runs[-1]), flush=True)
    fits = {}
    for mode in modes:
        pts = [(r["mean_running"], r["ms_per_step"]) for r in runs if r["mode"] == mode]
        fits[mode] = fit(pts)
    table = []
    for n in batches:
        row = {"batch": n}
        for mode in modes:
            vals = sorted(r["ms_per_step"] for r in runs if r["batch"] == n and r["mode"] == mode)
            row[mode] = vals[len(vals) // 2]
        table.append(row)
    print(f"{'N':>5} " + " ".join(f"{m + ' ms/step':>14}" for m in modes))
    for row in table:
        print(f"{row['batch']:>5} " + " ".join(f"{row[m]:>14.2f}" for m in modes))
    for mode, f in fits.items():
        print(f"{mode}: {f['fixed_ms']} ms a step + {f['per_request_us']} µs a request (max residual {f['max_residual_ms']} ms)")
    a.out.write_text(json.dumps({"shape": a.shape, "tokens": a.tokens, "engine_load_s": round(load_s, 1),
                                 "graph_sizes": GRAPH_SIZES, "medians": table, "fits": fits, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
