"""Guided decoding's token masks, made faster inside vLLM's engine core.

Every step, vLLM's scheduler fills a token mask per guided request and sends them to the GPU
before sampling; with async scheduling this runs while the GPU computes the step's forward pass,
and what runs over it leaves the GPU idle. Two of vLLM's fixed choices cost there, on vLLM 0.26
and 0.32 alike (vllm/v1/structured_output/__init__.py):

- It fills the masks one request after another up to 128 requests a step
  (`fill_bitmask_parallel_threshold`), on threads only above that. xgrammar releases the GIL while
  it fills (100 requests: 1.6x faster on 2 threads on this project's 2-core CPU), and under a
  tight KV cache the runner runs 40-125 requests at once, all below vLLM's threshold.
- xgrammar's mask buffer is not pinned memory, so each step the worker copies it into fresh
  pinned memory before the transfer (a profile of plain vLLM on the H200 put that copy above
  xgrammar's own filling: 446 against 243 of 3,304 engine-core samples).

`install()` wraps vLLM's StructuredOutputManager so that, where RUNNER_GRAMMAR_MASKS says so, it
fills on threads from a smaller batch and fills into a few pinned buffers in turn: a buffer is
filled again only after the steps that could still be copying it have finished (vLLM keeps at
most two steps in flight with one GPU). The engine settings `grammar_threads_from` and
`grammar_mask_pinned` decide; with neither, vLLM runs as it ships. The runner calls `install()`
before it starts vLLM (a forked or in-process engine core inherits the wrapped class), and vLLM
calls `register()` as a general plugin in engine processes it spawns. What the manager did is
written to a file every REPORT_STEPS steps, so that the runner reads it wherever the core runs.
"""
from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

ENV = "RUNNER_GRAMMAR_MASKS"
PINNED_BUFFERS = 4  # at least: vLLM's steps in flight (2 with one GPU) + 2, where it says more
BATCH = 8  # masks a thread fills at a time: 40 requests spread over 5 threads, vLLM's 16 over 3
REPORT_STEPS = 64
log = logging.getLogger("vllm.runner_grammar_masks")  # vLLM's handlers print it in its core's log


def environment(threads_from: Optional[int], pinned: bool, report: Optional[Path] = None) -> dict[str, str]:
    """The variable that carries the engine settings into vLLM's engine processes; `report`: the
    file the engine core writes what it did to."""
    return {ENV: json.dumps({"threads_from": threads_from, "pinned": pinned,
                             "report": None if report is None else str(report)})}


def read_report(path: Path) -> Optional[dict[str, Any]]:
    """What the engine core last wrote (None: it wrote nothing, e.g. a vLLM without the manager)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def settings() -> Optional[dict[str, Any]]:
    """The settings RUNNER_GRAMMAR_MASKS holds, or None (unset or unreadable: vLLM as it ships)."""
    raw = os.environ.get(ENV)
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def register() -> None:
    """vLLM's general-plugin hook (entry point `vllm.general_plugins`): wraps the manager only
    where the runner started this process, so plain vLLM beside it runs as it ships."""
    if settings() is not None:
        install()


def install() -> bool:
    """Wraps vLLM's StructuredOutputManager once; False where this vLLM has none."""
    try:
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError:
        return False
    return wrap(StructuredOutputManager)


def wrap(cls: type) -> bool:
    """Wraps a StructuredOutputManager class (tests pass a stand-in); False where its methods moved."""
    if getattr(cls, "_runner_masks", False):
        return True
    init, fill = getattr(cls, "__init__", None), getattr(cls, "grammar_bitmask", None)
    if init is None or fill is None:
        return False

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        tune(self, settings())

    def grammar_bitmask(self, requests, structured_output_request_ids, *args, **kwargs):
        pool = getattr(self, "_runner_pool", None)
        if pool:  # the next pinned buffer in turn: the copies of the steps before may still read the others
            self._runner_turn = (self._runner_turn + 1) % len(pool)
            self._grammar_bitmask = pool[self._runner_turn]
        out = fill(self, requests, structured_output_request_ids, *args, **kwargs)
        seen = getattr(self, "_runner_seen", None)
        if seen is not None and structured_output_request_ids:
            seen["steps"] += 1
            if len(structured_output_request_ids) > self.fill_bitmask_parallel_threshold:
                seen["threaded_steps"] += 1
            if pool is None and self._runner_pin and self._grammar_bitmask is not None:
                _pin(self)
            if seen["steps"] % REPORT_STEPS == 1:
                _report(self)
        return out

    cls.__init__, cls.grammar_bitmask, cls._runner_masks = __init__, grammar_bitmask, True
    return True


def tune(manager: Any, wanted: Optional[dict[str, Any]], cpus: Optional[int] = None) -> None:
    """Applies the settings to one manager after vLLM's own __init__ (None: leaves it as is)."""
    if not wanted:
        return
    limit = getattr(manager, "fill_bitmask_parallel_threshold", None)
    if not isinstance(limit, int):
        log.warning("runner: this vLLM fills token masks differently; left as it ships")
        return
    manager._runner_pool, manager._runner_turn, manager._runner_report = None, 0, wanted.get("report")
    config = getattr(manager, "vllm_config", None)
    # Only where the worker shares this process (vLLM's "uni" executor): other executors send the
    # masks to their workers by message, and pinning here would start CUDA in a process without it.
    uni = getattr(getattr(config, "parallel_config", None), "distributed_executor_backend", None) == "uni"
    manager._runner_pin = bool(wanted.get("pinned")) and uni and _cuda()
    manager._runner_seen = {"threads_from": limit, "workers": None, "pinned_buffers": 0,
                            "steps": 0, "threaded_steps": 0}
    threads_from = wanted.get("threads_from")
    if not isinstance(threads_from, int) or threads_from >= limit:
        return
    if not hasattr(manager, "_async_submit_fill_bitmask"):
        log.warning("runner: this vLLM fills token masks differently; left as it ships")
        return
    try:
        max_seqs = manager.vllm_config.scheduler_config.max_num_seqs
        drafts = manager.vllm_config.speculative_config is not None
    except AttributeError:
        return
    if max_seqs <= threads_from or drafts:
        return  # never more requests a step than the threshold, or drafts (vLLM then fills serially)
    pool = getattr(manager, "executor_for_fillmask", None)
    if getattr(pool, "_max_workers", 0) < 2:
        # vLLM makes its pool only where max_num_seqs passes 128, of half the CPUs (one thread on two
        # cores), and shuts it down with the backend wherever the threshold is below max_num_seqs
        if pool is not None:
            pool.shutdown(wait=False)
        workers = max(2, min((cpus or os.cpu_count() or 2) // 2, 8))
        manager.executor_for_fillmask = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="runner-masks")
    manager.fill_bitmask_parallel_batch_size = BATCH
    manager.fill_bitmask_parallel_threshold = threads_from
    workers = getattr(manager.executor_for_fillmask, "_max_workers", None)
    manager._runner_seen |= {"threads_from": threads_from, "workers": workers}


def _pin(manager: Any) -> None:
    """Pinned copies of the mask buffer vLLM allocated on its first step, filled in turn from now on."""
    in_flight = getattr(getattr(manager, "vllm_config", None), "max_concurrent_batches", 2)
    n = max(PINNED_BUFFERS, (in_flight if isinstance(in_flight, int) else 2) + 2)
    try:
        manager._runner_pool = [pinned_copy(manager._grammar_bitmask) for _ in range(n)]
    except RuntimeError as exc:  # no pinned memory here after all
        log.warning("runner: token masks stay unpinned: %s", exc)
        manager._runner_pin = False
        return
    manager._runner_seen["pinned_buffers"] = len(manager._runner_pool)


def pinned_copy(buffer: Any) -> Any:
    """A new pinned buffer holding `buffer`'s masks. Not `pin_memory()`, which returns a buffer
    already pinned as it is (llguidance's and outlines' are): the turns would all be one buffer."""
    import torch

    return torch.empty_like(buffer, pin_memory=True).copy_(buffer)


def _report(manager: Any) -> None:
    """Writes the manager's counts whole (a reader never sees half a file); never fails a step."""
    path = manager._runner_report
    if not path:
        return
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manager._runner_seen, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch, or a CUDA that cannot start: no pinned memory
        return False
