"""Admission policies against a simulated vLLM scheduler, on the CPU in seconds.

A GPU lease is 30 minutes; this replays a tight-cache workload through the runner's real Feed and
KvBudget (runner/engines/) and a small model of vLLM's V1 scheduler (bench/sim_vllm.py). Step time is a cost
model (fixed + per running request + per prefill token + per context token read) fitted by hand to
one 8B-shape runner run of an earlier lease (commit 347b337: 3,374 steps, 54.5 s); later leases ran
the same work in 32-34 s, so read its steps and requests in flight, and rank policies by them, not
its seconds. Its vLLM is simpler than vLLM (no chunked prefill, no cache hits on recompute of a
preempted request's freed blocks): it is far off for `sorted` and `plain`, close for the runner.
Then measure the winner on the GPU.

    python bench/admission_sim.py --shape 8b --out /tmp/sim.json
    python bench/admission_sim.py --shape 8b --prompt 1056,167 --policies runner,runner-noshared
    python bench/admission_sim.py --shape 8b --prompt 1056,167 --windows 260,520,1000,2000   # ramp, steady, tail

`--prompt 1056,167` is the invoices workload's split as measured on the H200 (1,223 prompt tokens
a row, 80.2% prefix hits); with it the simulator's runner before the shared-head fix
(`runner-noshared`) matched the GPU runs' steps and requests in flight within 5%.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from collections import deque
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sim_vllm import BT, SimReq, Vllm  # noqa: E402
from runner.engines.admission import KvBudget  # noqa: E402
from runner.engines.base import Request  # noqa: E402
from runner.engines.feed import Feed  # noqa: E402

# shape -> blocks, prefix tokens, private prompt tokens, output tokens (min, max), step cost (s):
# fixed, per running request, per prefill token, per context token
SHAPES = {
    "8b": dict(blocks=3072, prefix=980, private=243, out=(256, 256), max_tokens=256,
               cost=(3.5e-3, 80e-6, 37e-6, 0.027e-6)),
    # the 8B shape's step as measured on an H100 (bench/step_cost.py, 2026-12-05: 6.4-6.9 ms fixed, 25 us
    # a request at ~170 tokens of context and 60-69 us at ~1,300: the context's share is the last term)
    "8b-measured": dict(blocks=3072, prefix=980, private=243, out=(256, 256), max_tokens=256,
                        cost=(6.9e-3, 34e-6, 37e-6, 0.027e-6)),
    "135m": dict(blocks=1024, prefix=980, private=243, out=(40, 128), max_tokens=128,
                 cost=(4e-3, 120e-6, 0.5e-6, 0.0)),
    # the incidents workload on the 135M model (H200, commit 347b337: 592 prompt tokens a row, 39%
    # of them hits, outputs averaging 230 of max_tokens 320, 46% of rows not valid: most cut off);
    # run it with --groups 256 --long-rows 0.35
    "incidents": dict(blocks=1024, prefix=230, private=362, out=(80, 320), max_tokens=320,
                      cost=(4e-3, 120e-6, 0.5e-6, 0.0)),
}


def workload(docs: int, groups: int, shape: dict, seed: int = 0, long_rows: float = 0.0,
             long_groups: float = 0.0) -> list[SimReq]:
    """Output lengths uniform in the shape's range, except a share of rows (`long_rows`, each on its
    own) or of whole groups (`long_groups`: a prompt the model loops on) that run to max_tokens."""
    rnd, longs = random.Random(seed), random.Random(seed + 1_000_003)  # the base lengths never shift
    lo, hi = shape["out"]
    looping = {g for g in range(groups) if longs.random() < long_groups}
    reqs = []
    for i in range(docs):
        out, long_row = rnd.randint(lo, hi), longs.random() < long_rows
        reqs.append(SimReq(f"r{i}", f"g{i % groups}", shape["prefix"] + shape["private"],
                           shape["max_tokens"] if long_row or i % groups in looping else out))
    return reqs


class RunnerSide:
    """The runner's Feed and KvBudget driving the simulated vLLM (see `run` for the options)."""

    def __init__(self, opts: set, reqs: list[SimReq], shape: dict, max_num_seqs: int, clock):
        over = next((int(o[4:]) / 100 for o in opts if o.startswith("over")), 1.0)
        budget = KvBudget(None if "noadmit" in opts else int(shape["blocks"] * over), BT, max_running=max_num_seqs,
                          project="peaks" not in opts, pace="nopace" not in opts, usage_feedback="feedback" in opts)
        self.feed = Feed(budget, 4 * max_num_seqs, max(32, max_num_seqs // 4), "nowarm" not in opts,
                         clock=clock, waves="nowave" not in opts)
        if "seeded" in opts:  # a run reusing a stored calibration: its slice's lengths (another draw)
            budget.lengths.seed(random.Random(99).sample([r.out_len for r in reqs], min(64, len(reqs))))
        if "paceearly" in opts:  # a variant tried, not shipped: pace before any length is known, as
            # if every row ran to max_tokens (one length for all), instead of admitting by peaks then
            budget.uniform_outputs = lambda: not budget.lengths.known() or KvBudget.uniform_outputs(budget)
        ordered = sorted(reqs, key=lambda r: int(r.group[1:]))
        self.by_id = {r.rid: r for r in ordered}
        # shortNN: the runner believes each group's shared head NN tokens shorter than vLLM caches
        short = next((int(o[5:]) for o in opts if o.startswith("short")), 0)
        head = (shape["prefix"] - short) // BT * BT
        firsts = {r.group: r.rid for r in reversed(ordered)}  # a group's first row finds nothing cached
        self.pending = deque(Request(r.rid, r.group, [0] * r.prompt, shape["max_tokens"],
                                     0 if firsts[r.group] == r.rid else head,
                                     shared_tokens=0 if "noshared" in opts else head) for r in ordered)
        self.preemptions = 0
        self.next_usage_s = 1.0

    def send(self, eng: Vllm) -> None:
        feed = self.feed
        while self.pending and feed.room():
            feed.add([self.pending.popleft() for _ in range(min(feed.room(), len(self.pending)))])
        for a in feed.to_send():
            feed.sent(a.request.row_id, a)
            eng.waiting.append(self.by_id[a.request.row_id])

    def stepped(self, eng: Vllm, done: list[SimReq], seconds: float) -> None:
        """What VllmEngine.poll does after a step, in its order; vLLM's KV usage once a simulated
        second, read against the pool the budget believes in (overNNN makes it larger)."""
        budget = self.feed.budget
        budget.tick()
        if eng.preemptions > self.preemptions:
            budget.on_preemption()
            self.preemptions = eng.preemptions
        for r in eng.running:
            if r.made >= 1:
                self.feed.progressed(r.rid)
        for r in done:
            self.feed.finished(r.rid, r.out_len)
        self.feed.stepped()
        if seconds >= self.next_usage_s and self.feed.in_flight and budget.total_blocks:
            self.next_usage_s = seconds + 1.0
            budget.observe_usage(eng.used() / budget.total_blocks, len(eng.waiting))


def step_seconds(shape: dict, eng: Vllm, done: list, prefill: int, ctx: int, jitter: random.Random) -> float:
    fixed, per_req, per_prefill, per_ctx = shape["cost"]
    step_s = fixed + per_req * (len(eng.running) + len(done)) + per_prefill * prefill + per_ctx * ctx
    step_s += shape.get("mixed", 0.0) if prefill else 0.0
    return step_s * (jitter.lognormvariate(0, shape["noise"]) if shape.get("noise") else 1.0)


def window_means(trace: list[tuple[int, int]], bounds: list[int], blocks: int) -> list[dict]:
    """Requests running and KV usage (share of the blocks) averaged over the steps between bounds,
    the last window to the end: where a run stays below its steady state (ramp, tail)."""
    edges = [0, *sorted({b for b in bounds if 0 < b < len(trace)}), len(trace)]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        part = trace[lo:hi]
        out.append({"steps": f"{lo}-{hi}", "running": round(sum(r for r, _ in part) / len(part), 1),
                    "kv_usage": round(sum(u for _, u in part) / len(part) / blocks, 3)})
    return out


def run(policy: str, reqs: list[SimReq], shape: dict, max_num_seqs: int = 256,
        windows: Optional[list[int]] = None) -> dict:
    """policy: plain (arrival order straight to vLLM), sorted, or runner[-option...], options: nowarm,
    noadmit (no KV budget), peaks (no projection), nopace, nowave (admission waves off), feedback
    (the count checked against vLLM's usage: kv_usage_feedback), overNNN (a budget of NNN% of the
    blocks), shortNN (the runner counts NN fewer shared tokens a row than vLLM caches: a count above
    vLLM's own usage), noshared (requests do not carry their group's head: the runner before commit
    'shared_tokens' counted the head twice while a group's first row ran), paceearly (the pace
    before any output length is known, every row taken to run to max_tokens), seeded (the budget
    starts from 64 of the workload's own lengths: a stored calibration slice's, kv_lengths_from_calibration).
    windows: step bounds at which to split the run's means of requests running and KV usage.
    shape["mixed"]: seconds a step that prefills costs beyond one that only decodes (vLLM runs it
    piecewise, not as one CUDA graph); the runner's Cadence fits it from the simulated clock.
    shape["noise"]: the sigma of a lognormal factor on every step's time (a fixed seed)."""
    eng = Vllm(shape["blocks"], shape["prefix"], max_num_seqs=max_num_seqs)
    jitter = random.Random(7)
    steps = seconds = mixed_steps = finished = 0
    trace: list[tuple[int, int]] = []  # (requests running, blocks used) of each step
    side = None
    if policy in ("plain", "sorted"):
        eng.waiting.extend(sorted(reqs, key=lambda r: int(r.group[1:])) if policy == "sorted" else reqs)
    else:
        side = RunnerSide(set(policy.split("-")[1:]), reqs, shape, max_num_seqs, clock=lambda: seconds)
    while finished < len(reqs):
        if steps > 100 * len(reqs):  # a policy that stalls is reported, not waited for
            raise RuntimeError(f"{policy}: {finished} of {len(reqs)} rows done after {steps} steps")
        if side is not None:
            side.send(eng)
            if not eng.running and not eng.waiting:
                raise RuntimeError(f"{policy}: nothing in flight and nothing sent after {steps} steps: admission stalled")
        done, prefill, ctx = eng.step()
        steps += 1
        # as the step ran: its finished rows' blocks still held
        trace.append((len(eng.running) + len(done), eng.used() + sum(eng.private(r) for r in done)))
        mixed_steps += prefill > 0
        seconds += step_seconds(shape, eng, done, prefill, ctx, jitter)
        if side is not None:
            side.stepped(eng, done, seconds)
        finished += len(done)
    feed = side.feed if side is not None else None
    waves = feed.cadence.describe() if feed is not None else {}
    return {"policy": policy, "steps": steps, "sim_s": round(seconds, 2), "docs_per_s": round(len(reqs) / seconds, 1),
            "avg_running": round(sum(r for r, _ in trace) / steps, 1),
            "mean_kv_usage": round(sum(u for _, u in trace) / steps / eng.blocks, 3),
            "preemptions": eng.preemptions, "prefill_tokens": eng.prefill_tokens,
            "hit_rate": round(eng.hit_tokens / max(eng.query_tokens, 1), 3), "mixed_steps": mixed_steps,
            "kv_usage_correction_max_blocks": feed.budget.feedback.max_blocks if feed else None,
            "wave_holds": waves.get("wave_holds"), "waves_fitted": waves.get("waves_fitted"),
            "wave_fit": waves.get("wave_fit")} | ({"windows": window_means(trace, windows, eng.blocks)} if windows else {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--docs", type=int, default=1024)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--policies", default="plain,sorted,runner,runner-nowarm")
    ap.add_argument("--max-tokens", type=int, default=None, help="instead of the shape's")
    ap.add_argument("--prompt", default=None, help="PREFIX,PRIVATE prompt tokens, instead of the shape's")
    ap.add_argument("--long-rows", type=float, default=0.0, help="share of rows that run to max_tokens")
    ap.add_argument("--long-groups", type=float, default=0.0, help="share of groups whose rows all do")
    ap.add_argument("--seeds", default="0", help="workload seeds, comma-separated")
    ap.add_argument("--mixed-ms", type=float, default=0.0,
                    help="extra milliseconds of a step that prefills (not one CUDA graph); 0: the fitted cost model")
    ap.add_argument("--noise", type=float, default=0.0, help="sigma of a lognormal factor on each step's time")
    ap.add_argument("--windows", default="", help="step bounds, comma-separated: means of each stretch between them")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    shape = SHAPES[a.shape] | ({"max_tokens": a.max_tokens} if a.max_tokens else {}) | {"mixed": a.mixed_ms / 1e3, "noise": a.noise}
    if a.prompt:
        shape |= dict(zip(("prefix", "private"), map(int, a.prompt.split(","))))
    rows = []
    for seed in (int(x) for x in a.seeds.split(",")):
        for p in a.policies.split(","):
            reqs = workload(a.docs, a.groups, shape, seed, a.long_rows, a.long_groups)
            rows.append({"seed": seed} | run(p, reqs, shape, windows=[int(x) for x in a.windows.split(",") if x]))
            print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"shape": a.shape, "docs": a.docs, "groups": a.groups, "max_tokens": shape["max_tokens"],
                                     "prefix_tokens": shape["prefix"], "private_tokens": shape["private"],
                                     "long_rows": a.long_rows, "long_groups": a.long_groups,
                                     "mixed_ms": a.mixed_ms, "noise": a.noise, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
