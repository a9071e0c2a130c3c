"""CPU cost per output token outside the model: the guided-decoding mask and the detokenizer.

vLLM computes each running request's token mask on the CPU at every step (serially below 128
requests), in the engine core. For a small model that work, not the GPU, can bound the tokens per
second whatever the batch. This measures it for a workload's schema: one valid compact output
(`example_output`, as the runner's own choice uses), tokenized, replayed through `--batch`
matchers at once (fill every mask, then accept the token), for xgrammar and llguidance (vLLM's
`guidance`; `structured_output_backend: measure` picks between them the same way); and vLLM's
incremental detokenizer (tokenizers' DecodeStream) against one decode at the end. Each schema is
measured as it is and with its strings' maxLength dropped.

    python bench/grammar_cost.py --model ~/.cache/runner/models/smollm2-135m-instruct \\
        --workload invoices --batch 43 --out /tmp/grammar.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workload import WORKLOADS  # noqa: E402
from runner.engines.grammar_choice import SEPARATORS, backend_costs, decide, example_output  # noqa: E402
from runner.fingerprint import cpu_name  # noqa: E402


def without_max_length(schema: Any) -> Any:
    """The schema with every string's maxLength dropped: what the bound costs."""
    if isinstance(schema, dict):
        return {k: without_max_length(v) for k, v in schema.items() if k != "maxLength"}
    return [without_max_length(v) for v in schema] if isinstance(schema, list) else schema


def detokenize_costs(tok, token_ids: list[int], repeats: int = 200) -> tuple[float, float]:
    """Seconds per token: incremental (DecodeStream, as vLLM's fast detokenizer) and one decode."""
    from tokenizers.decoders import DecodeStream

    t0 = time.perf_counter()
    for _ in range(repeats):
        stream = DecodeStream(skip_special_tokens=True)
        for tid in token_ids:
            stream.step(tok._tokenizer, tid)
    incremental = (time.perf_counter() - t0) / (repeats * len(token_ids))
    t0 = time.perf_counter()
    for _ in range(repeats):
        tok.decode(token_ids, skip_special_tokens=True)
    return incremental, (time.perf_counter() - t0) / (repeats * len(token_ids))


def measure(model: str, workload: str, batch: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    schema = WORKLOADS[workload][2]
    text = json.dumps(example_output(schema), separators=SEPARATORS)
    ids = tok.encode(text, add_special_tokens=False)
    incremental, once = detokenize_costs(tok, ids)
    costs, unbounded = backend_costs(tok, schema, batch), backend_costs(tok, without_max_length(schema), batch)
    return {"workload": workload, "batch": batch, "output_tokens": len(ids), "output": text,
            "us_per_request_token": costs, "us_per_request_token_without_max_length": unbounded,
            "runner_picks": decide(costs)[0],
            "detokenize_incremental_us_per_token": round(incremental * 1e6, 2),
            "detokenize_once_us_per_token": round(once * 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model folder with the tokenizer")
    ap.add_argument("--workload", default="invoices,incidents", help="bench/workload.py names, comma-separated")
    ap.add_argument("--batch", type=int, default=43, help="requests whose masks each step fills")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    rows = [measure(a.model, w, a.batch) for w in a.workload.split(",")]
    print(f"{'workload':<10} {'tokens':>6} {'xgrammar us':>11} {'guidance us':>11} {'no maxLength: x / g us':>22} "
          f"{'picks':>8} {'detok incr/once us':>18}")
    for r in rows:
        c, u = r["us_per_request_token"], r["us_per_request_token_without_max_length"]
        print(f"{r['workload']:<10} {r['output_tokens']:>6} {c['xgrammar']:>11} {c['guidance']:>11} "
              f"{str(u['xgrammar']) + ' / ' + str(u['guidance']):>22} {r['runner_picks']:>8} "
              f"{str(r['detokenize_incremental_us_per_token']) + ' / ' + str(r['detokenize_once_us_per_token']):>18}")
    if a.out:
        a.out.write_text(json.dumps({"machine": cpu_name(),
                                     "date": date.today().isoformat(), "commit": a.commit, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
