"""The `ray` executor: engine replicas as Ray actors, behind the same Engine seam.

The driver keeps everything that makes a run safe (the lock, the plan, resume, SQLite writes,
stats); only generation moves. RayEngine routes whole groups (in chunks of `ray.group_chunk_rows`
rows) to replicas so that every replica still hits its prefix cache. Each replica runs an engine
built by a factory (vLLM in production, the fake engine in tests) through submit and poll. The
cluster is a seam too: RayCluster places replicas on Ray; LocalCluster runs them in this process,
so that routing and resume are tested without starting Ray.
"""
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


class GroupRouter:
    """Sends rows to replicas by group: a group sticks to one replica for `chunk_rows` rows, so that
    replica computes the shared prefix once; a new group or a full chunk goes to the least loaded."""

    def __init__(self, replicas: int, chunk_rows: int):
        self.outstanding = [0] * replicas
        self.chunk_rows = chunk_rows
        self._route: dict[str, tuple[int, int]] = {}  # group -> (replica, rows sent in this chunk)

    def assign(self, group_key: str) -> int:
        i, sent = self._route.get(group_key, (-1, 0))
        if i < 0 or sent >= self.chunk_rows:
            i, sent = min(range(len(self.outstanding)), key=self.outstanding.__getitem__), 0
        self._route[group_key] = (i, sent + 1)
        self.outstanding[i] += 1
        return i

    def finished(self, replica: int, rows: int) -> None:
        self.outstanding[replica] -= rows


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


class RayEngine(Engine):
    """Engine replicas on a cluster, behind the Engine seam."""

    def __init__(self, job, factory: Callable[[Any], Engine], cluster=None):
        cfg = job.spec.ray
        self.cluster = cluster if cluster is not None else RayCluster(job)
        self.replicas = self.cluster.start(factory, job, cfg.replicas)
        try:
            infos = [self._get(self.cluster.call(r, "info"), "failed to start") for r in self.replicas]
        except EngineError:
            self.close()
            raise
        self.router = GroupRouter(len(self.replicas), cfg.group_chunk_rows)
        self.cap = job.engine.max_in_flight or 4 * job.engine.max_num_seqs
        self.buffers: list[list[Request]] = [[] for _ in self.replicas]
        self.calls: dict[Any, int] = {}  # call in flight -> replica index
        self.info = EngineInfo(backend=f"{infos[0].backend}+ray", version=infos[0].version,
                               settings=infos[0].settings | {"replicas": cfg.replicas,
                                                             "gpus_per_replica": cfg.gpus_per_replica},
                               kv_total_blocks=infos[0].kv_total_blocks)

    def _get(self, call, what: str):
        try:
            return self.cluster.get(call)
        except EngineError:
            raise
        except Exception as exc:
            text = str(exc).strip().splitlines()
            raise EngineError(f"engine replica {what}: {text[-1] if text else exc.__class__.__name__}") from None

    def submit(self, requests: list[Request]) -> None:
        for req in requests:
            self.buffers[self.router.assign(req.group_key)].append(req)

    def capacity(self) -> int:
        return max(self.cap * len(self.replicas) - sum(self.router.outstanding), 0)

    def idle(self) -> bool:
        return not self.calls and not any(self.router.outstanding)

    def poll(self) -> list[Completion]:
        busy = set(self.calls.values())
        for i, replica in enumerate(self.replicas):  # one call in flight per replica; it takes all routed since
            if i not in busy and (self.buffers[i] or self.router.outstanding[i]):
                self.calls[self.cluster.call(replica, "step", self.buffers[i])] = i
                self.buffers[i] = []
        if not self.calls:
            return []
        done: list[Completion] = []
        for call in self.cluster.wait(list(self.calls)):
            i = self.calls.pop(call)
            finished = self._get(call, f"{i} failed")
            self.router.finished(i, len(finished))
            done += finished
        return done

    def counters(self) -> EngineCounters:
        total = EngineCounters()
        for r in self.replicas:
            total = total + self._get(self.cluster.call(r, "counters"), "failed")
        return total

    def expected_batch(self, req: Request) -> Optional[int]:
        """Per replica: speculation is decided per engine."""
        return self._get(self.cluster.call(self.replicas[0], "expected_batch", req), "failed")

    def output_lengths(self) -> list[int]:
        """Every replica's (each saw a share of the rows)."""
        return [n for r in self.replicas for n in self._get(self.cluster.call(r, "output_lengths"), "failed")]

    def seed_output_lengths(self, lengths: list[int]) -> int:
        """Every replica paces from them (each sees a share of the rows: the longest to learn its own)."""
        taken = [self._get(self.cluster.call(r, "seed_output_lengths", lengths), "failed") for r in self.replicas]
        return min(taken, default=0)

    def adaptation(self) -> dict:
        """Each replica's, and the driver's bytecode decision where it made one (before starting a
        local cluster: the prefix the replicas inherit, and the unused folders it removed)."""
        from runner import bytecode

        out = {"replicas": [self._get(self.cluster.call(r, "adaptation"), "failed") for r in self.replicas]}
        driver = bytecode.state()
        if driver["reason"] != bytecode.UNDECIDED:
            out["driver_bytecode_cache"] = driver
        return out

    def close(self) -> None:
        if getattr(self, "replicas", None):
            self.cluster.close(self.replicas)
        self.replicas = []
