"""What a user would write instead of the runner: read the Parquet, chat with vLLM's LLM, write JSONL.

The benchmark's baselines. vLLM's defaults, the same schema, max_tokens and compact JSON as the
runner (so that the comparison is about scheduling); `--sorted` sorts the rows by system prompt
first, as a user would try before anything else. Run as its own process; the benchmark times the
whole process. Prints one `RESULT {...}` line.

    python bench/plain_vllm.py --model M --input docs.parquet --schema s.json --max-tokens 128 --out r.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter


def main() -> None:
    a = _args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    t_read = time.perf_counter()
    rows = pq.read_table(a.input, columns=["doc_id", "text", "system_prompt"]).to_pylist()
    rows = rows[: a.limit] if a.limit else rows
    if a.sorted:
        rows.sort(key=lambda r: r["system_prompt"])  # stable: input order inside each prompt
    chats = [[{"role": "system", "content": r["system_prompt"]}, {"role": "user", "content": r["text"]}] for r in rows]
    schema = json.loads(open(a.schema, encoding="utf-8").read())
    read_s = time.perf_counter() - t_read

    t_load = time.perf_counter()
    llm = LLM(**_llm_kwargs(a))
    load_s = time.perf_counter() - t_load
    guided = None if a.no_schema else StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, seed=0, structured_outputs=guided)
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    metrics = _metrics(llm)
    valid = 0
    check = _validator(schema)
    with open(a.out, "w", encoding="utf-8") as f:
        for r, o in zip(rows, outs):
            text = o.outputs[0].text
            valid += check(text)
            f.write(json.dumps({"doc_id": r["doc_id"], "output": text}) + "\n")
    hits, queries = metrics.get("vllm:prefix_cache_hits", 0), metrics.get("vllm:prefix_cache_queries", 0)
    print("RESULT " + json.dumps({
        "rows": len(outs), "rows_valid": valid,
        "finish_reasons": dict(Counter(str(o.outputs[0].finish_reason) for o in outs)),
        "generation_s": round(gen_s, 3), "engine_load_s": round(load_s, 2),
        "read_s": round(read_s, 3), "documents_per_s": len(outs) / gen_s,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "preemptions": metrics.get("vllm:num_preemptions", 0),
        # engine steps (one observation of the tokens each step ran): beside the runner's loop.steps
        "engine_steps": metrics.get("vllm:iteration_tokens_total:count"),
        "kv_total_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }), flush=True)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--schema", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sorted", action="store_true", help="sort rows by system prompt before generating")
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="the tight regime: a KV cache of this many blocks")
    ap.add_argument("--load-format", default=None, help="dummy: random weights from the config alone")
    ap.add_argument("--cpu", action="store_true", help="settings the CPU engine needs to start (KV cap, eager)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=None, help="only the first N rows (a warm-up)")
    ap.add_argument("--backend", default="xgrammar", help="vLLM's structured-output backend")
    ap.add_argument("--no-schema", action="store_true", help="free text: what the token masks cost")
    ap.add_argument("--llm-kw", default="{}", help="JSON of extra LLM(...) arguments, for experiments")
    return ap.parse_args()


def _llm_kwargs(a: argparse.Namespace) -> dict:
    """LLM(...) as a user would start it: vLLM's defaults, the benchmark's schema settings."""
    kw = dict(model=a.model, max_model_len=a.max_model_len, disable_log_stats=False,
              structured_outputs_config={"backend": a.backend, "disable_any_whitespace": True})
    if a.num_gpu_blocks:
        kw["num_gpu_blocks_override"] = a.num_gpu_blocks
    if a.load_format:
        kw["load_format"] = a.load_format
    if a.cpu:  # the CPU engine refuses to start with its default memory fraction; same KV as the runner
        kw |= {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "block_size": 32}
    return kw | json.loads(a.llm_kw)


def _validator(schema: dict):
    """True for output that parses and fits the schema: what the runner stores as `ok`."""
    import jsonschema

    v = jsonschema.validators.validator_for(schema)(schema)

    def check(text: str) -> bool:
        try:
            return v.is_valid(json.loads(text))
        except ValueError:
            return False

    return check


def _metrics(llm) -> dict:
    """Counters and gauges by name (summed over engines); a histogram's count as NAME:count."""
    out: dict = {}
    for m in llm.get_metrics():
        v = getattr(m, "value", None)
        if isinstance(v, (int, float)):
            out[m.name] = out.get(m.name, 0) + v
        elif isinstance(getattr(m, "count", None), int):
            out[f"{m.name}:count"] = out.get(f"{m.name}:count", 0) + m.count
    return out


if __name__ == "__main__":
    main()
