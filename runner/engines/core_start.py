"""How vLLM starts its engine-core process inside a Ray actor: fork, not spawn, where that is safe.

vLLM forces `spawn` in every Ray actor. A spawned core imports vLLM and torch a second time, which
is most of what a replica's start costs beyond a local engine's (the H200 host: `LLM(...)` 19-24 s
in an actor against 14-19 s locally). The core of one engine of one GPU never calls Ray, so a
forked one, which inherits the actor's imports, is safe as long as CUDA is not started in the
actor (the same condition vLLM checks for a local engine). vLLM's CPU build spawns its core (and
its worker) whatever it is asked: what was done is read back after the start.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


@contextlib.contextmanager
def forked_core_in_ray_actor(tensor_parallel_size: int, in_process: bool) -> Iterator[dict]:
    """While vLLM starts: if this is a Ray actor whose environment asks for fork (`ray.engine_core_start`),
    keep vLLM from overriding it. Yields what was decided: {"method": "fork" | "spawn", "reason": ...};
    outside a Ray actor, or with the core in this process (in_process), {"method": None}."""
    decided: dict = {"method": None}
    if in_process:
        yield decided
        return
    try:
        from vllm.utils import system_utils
    except ImportError:  # another layout: vLLM decides as it always does
        yield decided
        return
    in_actor = getattr(system_utils, "is_in_ray_actor", None)
    if in_actor is None or not in_actor():
        yield decided
        return
    why = _why_not_fork(system_utils, tensor_parallel_size)
    decided.update(method="spawn" if why else "fork", reason=why or "the actor's imports are inherited")
    if why:
        yield decided
        return
    system_utils.is_in_ray_actor = lambda: False  # read by _maybe_force_spawn only, at the core's start
    try:
        yield decided
    finally:
        system_utils.is_in_ray_actor = in_actor
        if os.environ.get(METHOD_ENV) != "fork":  # vLLM's platform (the CPU build) or config chose spawn
            decided.update(method="spawn", reason=f"vLLM set {METHOD_ENV} to {os.environ.get(METHOD_ENV)!r}")


def _why_not_fork(system_utils, tensor_parallel_size: int) -> Optional[str]:
    """Why the core must be spawned here, or None."""
    if os.environ.get(METHOD_ENV) != "fork":
        return f"{METHOD_ENV} is {os.environ.get(METHOD_ENV)!r} (ray.engine_core_start)"
    if tensor_parallel_size != 1:  # its workers join a process group that may go through Ray
        return "tensor_parallel_size is not 1"
    cuda_started = getattr(system_utils, "cuda_is_initialized", lambda: True)
    if cuda_started():
        return "CUDA is initialized in the actor"
    return None
