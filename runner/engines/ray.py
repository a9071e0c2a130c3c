"""The `ray` executor: engine replicas as Ray actors, behind the same Engine seam.

The driver keeps everything that makes a run safe (the lock, the plan, resume, SQLite writes,
stats); only generation moves. RayEngine routes whole groups (in chunks of `ray.group_chunk_rows`
rows) to replicas so that every replica still hits its prefix cache. Each replica runs an engine
built by a factory (vLLM in production, the fake engine in tests) through submit and poll. The
cluster is a seam too (runner/engines/ray_cluster.py): RayCluster places replicas on Ray;
LocalCluster runs them in this process, so that routing and resume are tested without starting Ray.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from runner.engines.base import Completion, Engine, EngineCounters, EngineInfo, Request
from runner.engines.ray_cluster import RayCluster
from runner.errors import EngineError

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
