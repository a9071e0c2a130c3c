"""Where the `ray` executor's engine replicas run: EngineReplica is one engine fed through `step`;
RayCluster places replicas as Ray actors, LocalCluster runs them in this process (routing and
resume tested without starting Ray). runner/engines/ray.py routes rows to them."""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

from runner.engines.base import Completion, Engine, EngineCounters, EngineInfo, Request
from runner.engines.core_start import METHOD_ENV, engine_core_method
from runner.errors import EngineError
from runner.scratch import remove_scratch
from runner.signals import handlers_kept

_INIT_LOCK = threading.Lock()
_STEP_S = 0.05  # how long a replica call may gather completions before it answers


def ensure_ray(job):
    """Connect to the job's Ray cluster (ray.address, else RAY_ADDRESS), or start a local one."""
    with _INIT_LOCK:  # the input reader's thread and the engine may both get here first
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            _local_cluster_bytecode(job)
        import ray

        if not ray.is_initialized():
            _init_ray(ray, job)
    return ray


def _local_cluster_bytecode(job) -> None:
    """Before Ray starts a local cluster (and before its import): the driver then reads Ray's
    bytecode too, and the cluster's processes (each replica's actor imports Ray, the runner and
    vLLM) inherit the prefix from this environment. A remote cluster's workers would not."""
    from runner.bytecode import engine_bytecode, switched_off

    cfg = job.spec.ray
    if cfg.address or os.environ.get("RAY_ADDRESS") or switched_off(cfg.env):
        return
    engine_bytecode()


def _init_ray(ray, job) -> None:
    from runner.engines.vllm_settings import offline_environment

    cfg = job.spec.ray
    env = offline_environment(job.engine.in_process) | cfg.env
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(runtime_env={"env_vars": env}, include_dashboard=False, log_to_driver=False)
    if not address:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Logical CPUs: Ray Data's read tasks need a CPU beside the replicas, or they never run.
        cpus = cfg.local_num_cpus or int(cfg.replicas * cfg.cpus_per_replica) + 2
        # A short folder: Ray's unix socket paths must stay under 108 bytes.
        kwargs |= dict(num_cpus=cpus, object_store_memory=cfg.object_store_memory_bytes,
                       _temp_dir=os.path.join(tempfile.gettempdir(), f"runner-ray-{os.getuid()}"))
    with handlers_kept():  # Ray's SIGTERM handler would exit with no message, the run recorded failed
        ray.init(**({"address": address} if address else {}), **kwargs)


class EngineReplica:
    """One engine, fed through calls of `step` (a Ray actor in RayCluster)."""

    def __init__(self, factory: Callable[[Any], Engine], job, own_process: bool = False):
        """own_process: this is the replica's own process (a Ray actor), whose environment it sets."""
        if job.spec.ray.engine_in_process:
            # In a Ray actor vLLM spawns its engine-core process (fork is unsafe there), and that
            # process imports vLLM and torch again. Every engine gets a new actor (calibration's
            # too), so an actor's process holds one engine.
            job = job.model_copy(update={"engine": job.engine.model_copy(update={"in_process": True})})
        elif own_process:  # read by runner/engines/core_start.py when vLLM starts the core
            os.environ[METHOD_ENV] = engine_core_method(job.spec.ray)
        self.engine = factory(job)

    def info(self) -> EngineInfo:
        return self.engine.info

    def step(self, requests: list[Request]) -> list[Completion]:
        """Queue requests; return what finished, waiting for at least one while any is running."""
        self.engine.submit(requests)
        done: list[Completion] = []
        deadline = time.monotonic() + _STEP_S
        while True:
            done += self.engine.poll()
            if self.engine.idle() or (done and time.monotonic() > deadline):
                return done

    def counters(self) -> EngineCounters:
        return self.engine.counters()

    def expected_batch(self, req: Request) -> Optional[int]:
        return self.engine.expected_batch(req)

    def adaptation(self) -> dict:
        return self.engine.adaptation()

    def output_lengths(self) -> list[int]:
        return self.engine.output_lengths()

    def seed_output_lengths(self, lengths: list[int]) -> int:
        return self.engine.seed_output_lengths(lengths)

    def close(self, process_ends: bool = False) -> None:
        """Shut the engine down; process_ends: the actor's process is killed next, which runs no
        atexit handler, so vLLM's files go now (runner/scratch.py)."""
        self.engine.close()
        if process_ends:
            remove_scratch()


class RayCluster:
    """Replicas as Ray actors: one GPU (`ray.gpus_per_replica`) and CPUs each."""

    POLL_S = 1.0  # a blocked ray.get runs no signal handler: waits are cut into polls, SIGTERM seen between

    def __init__(self, job):
        self.ray = ensure_ray(job)
        self.cfg = job.spec.ray
        self.local = not (self.cfg.address or os.environ.get("RAY_ADDRESS"))  # a cluster this run started

    def start(self, factory: Callable, job, n: int) -> list:
        if self.local:
            self._check_room(n)
        actor = self.ray.remote(EngineReplica).options(num_gpus=self.cfg.gpus_per_replica,
                                                       num_cpus=self.cfg.cpus_per_replica)
        return [actor.remote(factory, job, True) for _ in range(n)]

    def _check_room(self, n: int) -> None:
        """EngineError where a local cluster cannot place the replicas: Ray would keep them pending,
        and the run would wait for ever without a word. (A remote cluster may be scaling up.)"""
        have = self.ray.cluster_resources()
        for name, each, hint in (("GPU", self.cfg.gpus_per_replica, "set ray.gpus_per_replica: 0 for replicas on "
                                  "the CPU, or fewer ray.replicas"),
                                 ("CPU", self.cfg.cpus_per_replica, "raise ray.local_num_cpus, or lower "
                                  "ray.cpus_per_replica")):
            need = n * each
            if need > have.get(name, 0) + 1e-9:
                raise EngineError(f"ray.replicas: {n} x ray.{name.lower()}s_per_replica {each:g} = {need:g} "
                                  f"{name}{'' if need == 1 else 's'}, but this machine's Ray cluster has "
                                  f"{have.get(name, 0):g} ({hint})")

    def call(self, replica, method: str, *args):
        return getattr(replica, method).remote(*args)

    def wait(self, calls: list) -> list:
        while True:
            ready, _ = self.ray.wait(calls, num_returns=1, timeout=self.POLL_S)
            if ready:
                return ready

    def get(self, call):
        while True:
            try:
                return self.ray.get(call, timeout=self.POLL_S)
            except self.ray.exceptions.GetTimeoutError:
                continue

    def close(self, replicas: list) -> None:
        """Shut every replica's engine down at once (each takes seconds), then kill the actors."""
        calls = []
        for r in replicas:
            try:
                calls.append(r.close.remote(True))
            except Exception:  # the replica may already be gone; killing it below is enough
                pass
        try:
            self.ray.get(calls, timeout=60)
        except Exception:  # one failed or hung: the kills below end them all
            pass
        for r in replicas:
            self.ray.kill(r)


class _Done:
    """A finished call of LocalCluster: its value, or the exception it raised."""

    def __init__(self, fn, *args):
        try:
            self.value, self.error = fn(*args), None
        except Exception as exc:
            self.value, self.error = None, exc


class LocalCluster:
    """Replicas in this process, called one after another: the same routing without Ray."""

    def start(self, factory: Callable, job, n: int) -> list:
        return [EngineReplica(factory, job) for _ in range(n)]

    def call(self, replica, method: str, *args) -> _Done:
        return _Done(getattr(replica, method), *args)

    def wait(self, calls: list) -> list:
        return calls[:1]

    def get(self, call: _Done):
        if call.error is not None:
            raise call.error
        return call.value

    def close(self, replicas: list) -> None:
        for r in replicas:
            r.close()
