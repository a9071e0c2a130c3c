"""The `ray` executor: the same run loop, with engine replicas as Ray actors.

The driver keeps everything that makes a run safe (the lock, the plan, resume, SQLite writes,
stats); only generation moves. `RayEngine` sits behind the same Engine seam as the local vLLM
engine: it routes whole groups (in chunks of `ray.group_chunk_rows` rows) to replicas so that every
replica still hits its prefix cache, and each `EngineReplica` runs the local `VllmEngine` on a
live queue. Input is read with Ray Data. Results stream back to the driver, which upserts them.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from collections import deque
from typing import Iterable, Iterator

from runner.engines.base import PAUSE, Completion, EngineCounters, EngineInfo, Request
from runner.errors import EngineError
from runner.spec import Job

_INIT_LOCK = threading.Lock()
_STEP_S = 0.05  # how long a replica call may gather completions before it answers


def ensure_ray(job: Job):
    """Connect to the job's Ray cluster (ray.address, else RAY_ADDRESS), or start a local one."""
    import ray

    with _INIT_LOCK:  # the input reader's thread and the engine may both get here first
        if not ray.is_initialized():
            _init_ray(ray, job)
    return ray


def _init_ray(ray, job: Job) -> None:
    from runner.engines.vllm_settings import offline_environment

    cfg = job.spec.ray
    env = offline_environment(job.engine.in_process) | cfg.env
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(runtime_env={"env_vars": env}, include_dashboard=False, log_to_driver=False)
    if address:
        ray.init(address=address, **kwargs)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Logical CPUs: Ray Data's read tasks need a CPU beside the replicas, or they never run.
        cpus = cfg.local_num_cpus or int(cfg.replicas * cfg.cpus_per_replica) + 2
        # A short folder: Ray's unix socket paths must stay under 108 bytes.
        ray.init(num_cpus=cpus, object_store_memory=cfg.object_store_memory_bytes,
                 _temp_dir=os.path.join(tempfile.gettempdir(), f"runner-ray-{os.getuid()}"), **kwargs)


def ray_documents(job: Job):
    """The job's rows through Ray Data, in file order."""
    from runner.inputs import documents_from_batches, input_files, needed_columns

    ray = ensure_ray(job)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # deterministic plans, same as the local reader
    spec = job.spec.input
    files = input_files(job.input_path)
    ds = ray.data.read_parquet(files, columns=needed_columns(spec))
    if spec.limit:
        ds = ds.limit(spec.limit)
    batches = ((job.input_path, b) for b in ds.iter_batches(batch_size=spec.batch_rows, batch_format="pyarrow"))
    return documents_from_batches(batches, spec, job.system_prompt)


class EngineReplica:
    """One vLLM engine in a Ray actor, fed through a queue (wrapped by ray.remote in RayEngine)."""

    def __init__(self, cfg, model_path, sampling, schema):
        from runner.engines.vllm_engine import VllmEngine

        self.engine = VllmEngine(cfg, model_path, sampling, schema)
        self.queue: deque[Request] = deque()
        self.stream = self.engine.generate(self._source())

    def _source(self):
        while True:
            yield self.queue.popleft() if self.queue else PAUSE

    def info(self) -> EngineInfo:
        return self.engine.info

    def step(self, requests: list[Request]) -> list[Completion]:
        """Queue requests; return what finished, waiting for at least one while any is in flight."""
        self.queue.extend(requests)
        done: list[Completion] = []
        deadline = time.monotonic() + _STEP_S
        while True:
            c = next(self.stream)
            if c is None:  # idle: nothing queued or in flight
                return done
            done.append(c)
            if time.monotonic() > deadline:
                return done

    def counters(self) -> EngineCounters:
        return self.engine.counters()

    def expected_batch(self, req: Request) -> int:
        return self.engine.expected_batch(req)

    def adaptation(self) -> dict:
        return self.engine.adaptation()

    def close(self) -> None:
        self.engine.close()


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


class RayEngine:
    """Engine replicas on a Ray cluster, behind the Engine seam."""

    def __init__(self, job: Job):
        ray = ensure_ray(job)
        cfg = job.spec.ray
        actor = ray.remote(EngineReplica).options(num_gpus=cfg.gpus_per_replica, num_cpus=cfg.cpus_per_replica)
        self.ray = ray
        self.replicas = [actor.remote(job.engine, job.model_path, job.spec.sampling, job.output_schema)
                         for _ in range(cfg.replicas)]
        try:
            infos = ray.get([r.info.remote() for r in self.replicas])
        except Exception as exc:  # the actor's constructor failed: vLLM did not start
            self.close()
            raise EngineError(f"engine replica failed to start: {_cause(exc)}") from None
        self.chunk_rows = cfg.group_chunk_rows
        self.cap = job.engine.max_in_flight or 4 * job.engine.max_num_seqs
        self.info = EngineInfo(backend="vllm+ray", version=infos[0].version,
                               settings=infos[0].settings | {"replicas": cfg.replicas,
                                                             "gpus_per_replica": cfg.gpus_per_replica},
                               kv_total_blocks=infos[0].kv_total_blocks)

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        n = len(self.replicas)
        source = iter(requests)
        router = GroupRouter(n, self.chunk_rows)
        buffers: list[list[Request]] = [[] for _ in range(n)]
        calls: dict = {}  # object ref -> replica index
        exhausted = False
        while True:
            while not exhausted and sum(router.outstanding) < self.cap * n:
                req = next(source, None)
                if req is None:
                    exhausted = True
                    break
                buffers[router.assign(req.group_key)].append(req)
            busy = set(calls.values())
            for i in range(n):  # one call in flight per replica; it takes everything routed since
                if i not in busy and (buffers[i] or router.outstanding[i]):
                    calls[self.replicas[i].step.remote(buffers[i])] = i
                    buffers[i] = []
            if not calls:
                if exhausted:
                    return
                continue
            ready, _ = self.ray.wait(list(calls), num_returns=1)
            for ref in ready:
                i = calls.pop(ref)
                try:
                    done = self.ray.get(ref)
                except Exception as exc:
                    raise EngineError(f"engine replica {i} failed: {_cause(exc)}") from None
                router.finished(i, len(done))
                yield from done

    def counters(self) -> EngineCounters:
        total = EngineCounters()
        for c in self.ray.get([r.counters.remote() for r in self.replicas]):
            total = total + c
        return total

    def expected_batch(self, req: Request) -> int:
        """Per replica: speculation is decided per engine."""
        return self.ray.get(self.replicas[0].expected_batch.remote(req))

    def adaptation(self) -> dict:
        return {"replicas": self.ray.get([r.adaptation.remote() for r in self.replicas])}

    def close(self) -> None:
        for r in getattr(self, "replicas", []):
            try:
                self.ray.get(r.close.remote(), timeout=60)
            except Exception:  # the replica may already be gone; killing it below is enough
                pass
            self.ray.kill(r)
        self.replicas = []


def _cause(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else exc.__class__.__name__

