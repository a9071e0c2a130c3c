"""How vLLM starts its engine-core process inside a Ray actor: fork, not spawn, where that is safe.

vLLM forces `spawn` in every Ray actor. A spawned core imports vLLM and torch a second time, which
is most of what a replica's start costs beyond a local engine's (2x H200 at 253e960: `LLM(...)`
21.7-28.5 s spawned, 12.5-17.9 s forked). The core of one engine on one device, run by vLLM's own
executor, never calls Ray, so a forked one, which inherits the actor's imports, is safe as long as
CUDA is not started in the actor (the condition vLLM checks for a local engine). An engine whose
workers may go through Ray (several devices, data parallel, `distributed_executor_backend: ray`)
is spawned as vLLM does: a forked child would inherit the actor's Ray connection, which does not
work there. vLLM's CPU build spawns its core (and its worker) whatever it is asked: what was
done is read back after the start.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
# vLLM arguments (extra_args) under which the engine's workers may be several (any but 1), or Ray's ("ray")
_PARALLEL_ARGS = ("pipeline_parallel_size", "data_parallel_size", "tensor_parallel_size")
_BACKEND_ARGS = ("distributed_executor_backend", "data_parallel_backend")


def engine_core_method(ray_spec) -> str:
    """What a replica asks vLLM for: a method the job's `ray.env` sets wins over `ray.engine_core_start`."""
    return ray_spec.env.get(METHOD_ENV) or ray_spec.engine_core_start


@contextlib.contextmanager
def forked_core_in_ray_actor(cfg) -> Iterator[dict]:
    """While vLLM starts the engine of `cfg` (an EngineConfig): if this is a Ray actor whose
    environment asks for fork (set by the replica), keep vLLM from overriding it. Yields what was
    decided, {"method": "fork" | "spawn", "reason": ...}; outside a Ray actor, or with the core in
    this process (in_process), {"method": None}."""
    decided: dict = {"method": None}
    system_utils = None if cfg.in_process else _vllm_system_utils()
    in_actor = getattr(system_utils, "is_in_ray_actor", None)
    if in_actor is not None and in_actor():
        why = _why_not_fork(system_utils, cfg)
        decided.update(method="spawn" if why else "fork", reason=why or "the actor's imports are inherited")
    forking = decided["method"] == "fork"
    if forking:
        system_utils.is_in_ray_actor = lambda: False  # read by _maybe_force_spawn only (vLLM 0.26 and 0.32)
    try:
        yield decided
    finally:
        if forking:
            system_utils.is_in_ray_actor = in_actor
            if os.environ.get(METHOD_ENV) != "fork":  # vLLM's platform (the CPU build) or config chose spawn
                decided.update(method="spawn", reason=f"vLLM set {METHOD_ENV} to {os.environ.get(METHOD_ENV)!r}")


def _vllm_system_utils():
    try:
        from vllm.utils import system_utils
    except ImportError:  # another layout: vLLM decides as it always does
        return None
    return system_utils


def _why_not_fork(system_utils, cfg) -> Optional[str]:
    """Why the core must be spawned here, or None."""
    if os.environ.get(METHOD_ENV) != "fork":
        return f"{METHOD_ENV} is {os.environ.get(METHOD_ENV)!r} (ray.engine_core_start or ray.env)"
    extra = cfg.extra_args
    several = [k for k in _PARALLEL_ARGS if int(extra.get(k) or 1) != 1]
    if cfg.tensor_parallel_size != 1 or several:
        return f"{', '.join(several) or 'tensor_parallel_size'} is not 1: its workers may go through Ray"
    ray_backend = [k for k in _BACKEND_ARGS if extra.get(k) == "ray"]
    if ray_backend:
        return f"{ray_backend[0]} is ray"
    cuda_started = getattr(system_utils, "cuda_is_initialized", lambda: True)
    if cuda_started():
        return "CUDA is initialized in the actor"
    return None
