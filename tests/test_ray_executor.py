"""The ray executor: group routing, replicas of the fake engine on an in-process cluster (routing,
resume), and a real local Ray cluster with one real vLLM replica whose results equal the local
executor's. Every real Ray run has a hard timeout: Ray can hang silently on a small machine."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from runner.engines.fake import FakeEngine
from runner.engines.ray import GroupRouter, RayEngine
from runner.engines.ray_cluster import LocalCluster
from runner.run import run_job
from runner.spec import load_job
from tests.conftest import SCHEMA
from tests.test_crash_safety import runner_cmd


def test_router_keeps_groups_together_and_balances_new_ones():
    r = GroupRouter(replicas=2, chunk_rows=3)
    a = [r.assign("A") for _ in range(3)]
    b = [r.assign("B") for _ in range(2)]
    assert a == [0, 0, 0] and b == [1, 1]  # whole groups, the new one on the idle replica
    assert r.assign("A") == 1  # A's chunk is full: its next rows go to the less loaded replica
    r.finished(0, 3)
    assert r.assign("C") == 0 and r.outstanding == [1, 3]


def test_router_never_splits_a_chunk_round_robin():
    r = GroupRouter(replicas=4, chunk_rows=100)
    assert {r.assign("G") for _ in range(50)} == {0}


class Replicas:
    """Fake-engine replicas on the in-process cluster, remembering which rows each one ran."""

    def __init__(self):
        self.engines: list[FakeEngine] = []

    def factory(self, job):
        e = FakeEngine(SCHEMA)
        self.engines.append(e)
        return e

    def engine(self, job):
        return RayEngine(job, self.factory, cluster=LocalCluster())


def test_replicas_each_get_whole_groups_and_every_row_once(make_job, tmp_path):
    job = load_job(make_job(rows=24, job={"ray": {"replicas": 2, "group_chunk_rows": 100}}))
    replicas = Replicas()
    s = run_job(job, engine_factory=replicas.engine)
    assert s.stats["rows_total"] == 24 and s.counts["ok"] == 24
    ran = [[r.row_id for r in e.seen] for e in replicas.engines]
    assert sorted(sum(ran, [])) == [f"r{i:03d}" for i in range(24)] and all(ran)  # both worked, no row twice
    groups = [{r.group_key for r in e.seen} for e in replicas.engines]
    assert groups[0].isdisjoint(groups[1])  # a group's rows stay on one replica (its prefix cache)
    assert s.stats["prefix_cache_hits"] > 0  # counters come back from every replica


@pytest.mark.parametrize("setting, expected", [(None, False), (False, False), (True, True)])
def test_ray_engine_in_process_keeps_the_engine_core_in_the_actor(make_job, setting, expected):
    """In a Ray actor vLLM would spawn its engine core and import itself again: with
    ray.engine_in_process the replica keeps it in the actor's process; off, the engine config decides."""
    ray = {"replicas": 1} | ({} if setting is None else {"engine_in_process": setting})
    job = load_job(make_job(rows=3, engine={"in_process": False}, job={"ray": ray}))
    seen = []
    factory = lambda j: seen.append(j.engine.in_process) or FakeEngine(SCHEMA)  # noqa: E731
    run_job(job, engine_factory=lambda j: RayEngine(j, factory, cluster=LocalCluster()))
    assert seen == [expected]


def test_resume_through_replicas_runs_only_what_is_missing(make_job, tmp_path):
    path = make_job(rows=12, job={"ray": {"replicas": 2}})
    run_job(load_job(path), engine_factory=Replicas().engine)
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tests.conftest import write_docs

    docs = write_docs(tmp_path / "data" / "docs.parquet", 16)  # 4 new rows
    assert pq.read_table(docs).num_rows == 16 and pa
    replicas = Replicas()
    s = run_job(load_job(path), engine_factory=replicas.engine)
    assert s.rows_skipped == 12 and s.stats["rows_total"] == 4
    assert sorted(r.row_id for e in replicas.engines for r in e.seen) == [f"r{i:03d}" for i in range(12, 16)]


def run_bounded(args, timeout_s=600, tmpdir=None):
    """Run the CLI in its own process group (with TMPDIR=tmpdir if given); kill the whole group
    (Ray's helpers too) on timeout."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled") | ({"TMPDIR": str(tmpdir)} if tmpdir else {})
    proc = subprocess.Popen(runner_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(map(str, args))} did not finish in {timeout_s} s")
    return proc.returncode, out, err


@pytest.mark.vllm
def test_ray_executor_results_equal_the_local_executor(make_job, tmp_path):
    # One sequence at a time: generation is then independent of how requests were batched, so the
    # two executors must produce the same extractions to the byte.
    job = make_job(rows=6, engine={"max_num_seqs": 1},
                   job={"ray": {"replicas": 1, "gpus_per_replica": 0, "cpus_per_replica": 1}})
    spec = yaml.safe_load(job.read_text())
    ray_job = tmp_path / "ray.yaml"
    # The engine config asks for an engine-core process of its own; ray.engine_in_process keeps it
    # in the actor's process, as the stored settings show below.
    ray_spec = spec | {"name": "t-ray", "output": spec["output"] | {"database": "out/ray.sqlite"}}  # same exit rule
    ray_spec["engine"] = ray_spec["engine"] | {"in_process": False}
    ray_spec["ray"] = ray_spec["ray"] | {"engine_in_process": True}
    ray_job.write_text(yaml.safe_dump(ray_spec))

    rc, _, err = run_bounded(["run", "--quiet", job])
    assert rc == 0, err[-2000:]
    tmp = Path(tempfile.mkdtemp(dir="/tmp"))  # short: vLLM's and Ray's socket paths must fit 107 bytes
    try:
        rc, out, err = run_bounded(["run", "--executor", "ray", ray_job], tmpdir=tmp)
        assert rc == 0, err[-3000:]
        assert "Results:" in out
        # The replica's actor is killed (no atexit handler): vLLM's files went with its engine; Ray
        # keeps its session folder.
        assert [p.name for p in tmp.iterdir()] == [f"runner-ray-{os.getuid()}"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    local = dict(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT row_id, extraction_json FROM results"))
    con = sqlite3.connect(tmp_path / "out" / "ray.sqlite")
    remote = dict(con.execute("SELECT row_id, extraction_json FROM results"))
    assert sorted(remote) == [f"r{i:03d}" for i in range(6)]
    assert remote == local
    backend, settings = con.execute("SELECT engine_backend, engine_settings_json FROM runs").fetchone()
    assert backend == "vllm+ray" and '"replicas": 1' in settings
    assert json.loads(settings)["engine_core"] == "InprocClient"
    st = con.execute("SELECT rows_total, prefix_cache_hits, completion_tokens FROM run_stats").fetchone()
    assert st[0] == 6 and st[1] > 0 and st[2] > 0  # counters come back from the replica
    # Resume works the same: a rerun finds every row done.
    rc, out, err = run_bounded(["run", "--executor", "ray", ray_job])
    assert rc == 0 and "0 run, 6 already done" in out, err[-2000:]


def _vllm_system_utils(monkeypatch, in_actor: bool, cuda: bool = False):
    """A stand-in for vllm.utils.system_utils (the names runner/engines/core_start.py reads)."""
    import types

    fake = types.ModuleType("vllm.utils.system_utils")
    fake.is_in_ray_actor = lambda: in_actor
    fake.cuda_is_initialized = lambda: cuda
    utils = types.ModuleType("vllm.utils")
    utils.system_utils = fake
    for name, module in (("vllm", types.ModuleType("vllm")), ("vllm.utils", utils), ("vllm.utils.system_utils", fake)):
        monkeypatch.setitem(sys.modules, name, module)
    return fake


def _engine_cfg(tp: int = 1, in_process: bool = False, **extra):
    """The EngineConfig fields runner/engines/core_start.py reads."""
    import types

    return types.SimpleNamespace(tensor_parallel_size=tp, in_process=in_process, extra_args=extra)


# seen: vLLM's check is told "not a Ray actor" while the core starts
@pytest.mark.parametrize("asked, in_actor, cuda, cfg, seen, expected", [
    ("fork", True, False, _engine_cfg(), True, ("fork", "inherited")),
    ("spawn", True, False, _engine_cfg(), False, ("spawn", "ray.engine_core_start")),
    ("fork", True, True, _engine_cfg(), False, ("spawn", "CUDA is initialized")),
    ("fork", True, False, _engine_cfg(tp=2), False, ("spawn", "tensor_parallel_size")),
    # workers that may go through Ray: a forked child would inherit the actor's Ray connection
    ("fork", True, False, _engine_cfg(pipeline_parallel_size=2), False, ("spawn", "pipeline_parallel_size")),
    ("fork", True, False, _engine_cfg(distributed_executor_backend="ray"), False, ("spawn", "distributed_executor_backend")),
    ("fork", True, False, _engine_cfg(distributed_executor_backend="uni"), True, ("fork", "inherited")),
    ("fork", False, False, _engine_cfg(), False, (None, None)),  # a local engine: vLLM decides
    ("fork", True, False, _engine_cfg(in_process=True), False, (None, None)),  # no core process to start
])
def test_a_replica_forks_its_core_only_where_vllm_would_fork_a_local_one(monkeypatch, asked, in_actor, cuda, cfg,
                                                                         seen, expected):
    from runner.engines.core_start import forked_core_in_ray_actor

    fake = _vllm_system_utils(monkeypatch, in_actor, cuda)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", asked)
    with forked_core_in_ray_actor(cfg) as decided:
        assert fake.is_in_ray_actor() == (in_actor and not seen)  # what vLLM's _maybe_force_spawn reads meanwhile
    assert fake.is_in_ray_actor() == in_actor  # put back once the core has started
    assert decided["method"] == expected[0]
    assert expected[1] is None or expected[1] in decided["reason"]


def test_a_fork_that_vllm_overrode_is_recorded_as_spawn(monkeypatch):
    """vLLM's CPU build sets the method to spawn while it starts, whatever it was asked."""
    from runner.engines.core_start import forked_core_in_ray_actor

    _vllm_system_utils(monkeypatch, in_actor=True)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with forked_core_in_ray_actor(_engine_cfg()) as decided:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    assert decided["method"] == "spawn" and "vLLM set" in decided["reason"]


def test_vllms_check_is_put_back_when_its_start_fails(monkeypatch):
    from runner.engines.core_start import forked_core_in_ray_actor

    fake = _vllm_system_utils(monkeypatch, in_actor=True)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(RuntimeError, match="no memory"):
        with forked_core_in_ray_actor(_engine_cfg()):
            assert not fake.is_in_ray_actor()
            raise RuntimeError("no memory")
    assert fake.is_in_ray_actor()  # a later start in this process is spawned as vLLM would


@pytest.mark.parametrize("ray, own_process, expected", [
    ({}, True, "fork"),
    ({"engine_core_start": "spawn"}, True, "spawn"),
    ({"env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}}, True, "spawn"),  # the job's ray.env wins
    ({"engine_in_process": True}, True, None),  # no core process: nothing to ask
    ({}, False, None),  # a replica in the caller's process (LocalCluster) leaves its environment alone
])
def test_a_replica_asks_vllm_for_the_jobs_method_in_its_own_process(make_job, monkeypatch, ray, own_process, expected):
    from runner.engines.ray_cluster import EngineReplica

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)  # put back after the test
    job = load_job(make_job(rows=2, job={"ray": {"replicas": 1} | ray}))
    seen = []
    EngineReplica(lambda j: seen.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")) or FakeEngine(SCHEMA), job,
                  own_process)
    assert seen == [expected]


@pytest.mark.vllm
def test_vllm_forces_spawn_where_the_replica_expects_it():
    """core_start.py replaces vllm.utils.system_utils.is_in_ray_actor, which _maybe_force_spawn
    must look up in that module's globals at call time; a vLLM that moved it would spawn every core
    again, silently (vLLM 0.26's source reads the same)."""
    from vllm.utils import system_utils

    force = system_utils._maybe_force_spawn
    assert force.__globals__ is vars(system_utils)
    assert "is_in_ray_actor" in force.__code__.co_names
    assert "_maybe_force_spawn" in system_utils.get_mp_context.__code__.co_names


@pytest.mark.vllm
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_replica_forks_its_engine_core_unless_told_to_spawn(make_job, tmp_path, method):
    """vLLM spawns its engine core in a Ray actor (importing vLLM and torch again); a replica asks it
    to fork (ray.engine_core_start), records what vLLM did, and makes the local executor's results."""
    job = make_job(rows=4, engine={"max_num_seqs": 1, "in_process": False},
                   job={"ray": {"replicas": 1, "gpus_per_replica": 0, "cpus_per_replica": 1,
                                "engine_core_start": method}})
    rc, _, err = run_bounded(["run", "--quiet", "--executor", "local", job])
    assert rc == 0, err[-2000:]
    spec = yaml.safe_load(job.read_text())
    ray_job = tmp_path / "ray.yaml"
    ray_job.write_text(yaml.safe_dump(spec | {"name": "t-ray", "output": spec["output"] | {"database": "out/ray.sqlite"}}))
    tmp = Path(tempfile.mkdtemp(dir="/tmp"))  # short: vLLM's and Ray's socket paths must fit 107 bytes
    try:
        rc, out, err = run_bounded(["run", "--executor", "ray", ray_job], tmpdir=tmp)
        assert rc == 0, err[-3000:]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    local = dict(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT row_id, extraction_json FROM results"))
    con = sqlite3.connect(tmp_path / "out" / "ray.sqlite")
    assert dict(con.execute("SELECT row_id, extraction_json FROM results")) == local and len(local) == 4
    settings, choice = con.execute("SELECT r.engine_settings_json, s.engine_choice_json FROM runs r "
                                   "JOIN run_stats s ON s.run_id = r.id").fetchone()
    assert json.loads(settings)["engine_core"] == "SyncMPClient"  # a process of its own
    core = json.loads(choice)["engines"][0]["replicas"][0]["start"]["engine_core_start"]
    # vLLM's CPU build spawns its core whatever it is asked (its platform sets the method): asked
    # to fork, the replica records that vLLM did not; asked to spawn, that the job said so
    assert core["method"] == "spawn", core
    assert ("vLLM set" if method == "fork" else "ray.engine_core_start") in core["reason"], core


READ_BOTH = """
import json, sys
from runner.readers import LocalReader, RayDataReader
from runner.spec import load_job
job = load_job(sys.argv[1], executor="ray")
rows = lambda reader: [r for _, b in reader.batches() for r in b.to_pylist()]
print(json.dumps([rows(LocalReader(job.input_path, job.spec.input)),
                  rows(RayDataReader(job.input_path, job.spec.input, job))]))
"""


def _read_both(job: Path) -> tuple[list, list]:
    """The job's rows as LocalReader and RayDataReader read them (in a process of its own: Ray)."""
    short = tempfile.mkdtemp(dir="/tmp")  # Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_AUTH_MODE="disabled", TMPDIR=short)
    proc = subprocess.Popen([sys.executable, "-c", READ_BOTH, str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("reading with Ray did not finish in 300 s")
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert proc.returncode == 0, err[-2000:]
    local, ray = json.loads(out.strip().splitlines()[-1])
    return local, ray


@pytest.mark.parametrize("name", ["docs.csv", "docs.csv.gz"])
def test_ray_data_reads_a_csv_as_the_local_reader_does(make_job, tmp_path, name):
    """`executor: ray` read CSV with Ray's defaults: the id 007 became 7 and NA a null id, so the
    same input stored other ids than a local run (and resumed neither's rows). A gzipped CSV is
    read decompressed by both."""
    import gzip

    text = b'id,text,system_prompt\n007,"first\nsecond",S\nNA,null,S\n9,,S\n'
    (tmp_path / name).write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    job = make_job(job={"input": {"path": name}, "ray": {"replicas": 1, "cpus_per_replica": 1}})
    local, ray = _read_both(job)
    assert local == [{"id": "007", "text": "first\nsecond", "system_prompt": "S"},
                     {"id": "NA", "text": "null", "system_prompt": "S"}, {"id": "9", "text": None, "system_prompt": "S"}]
    assert ray == local


def test_ray_reads_json_lines_whose_id_changes_type_as_a_local_run_does(make_job, tmp_path):
    """Ray Data's read_json failed on ids 7 then "r8" (a RayTaskError from its read task), a file a
    local run reads, its ids as text."""
    rows = [{"id": 7, "text": "a", "system_prompt": "S"}, {"id": "r8", "text": "b", "system_prompt": "S"},
            {"id": 9, "text": "c", "system_prompt": "S"}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = make_job(job={"input": {"path": "docs.jsonl"}, "ray": {"replicas": 1, "cpus_per_replica": 1}})
    local, ray = _read_both(job)
    assert [r["id"] for r in local] == ["7", "r8", "9"]
    assert ray == local


@pytest.mark.parametrize("decided", [True, False])
def test_the_drivers_bytecode_decision_is_recorded_beside_the_replicas(make_job, monkeypatch, decided):
    """Before a local cluster starts, the driver decides the bytecode prefix (and removes folders
    unused for 30 days): the run's stats keep that decision beside each replica's, and nothing
    where the driver made none (a remote cluster)."""
    from runner import bytecode

    state = ({"prefix": "/c/pycache/x", "set_by_runner": True, "reason": "no bytecode beside torch",
              "pruned": ["/c/pycache/old"]} if decided else dict(bytecode._state, reason=bytecode.UNDECIDED))
    monkeypatch.setattr(bytecode, "_state", state)
    job = load_job(make_job(rows=4, job={"ray": {"replicas": 2}}))
    run_job(job, engine_factory=Replicas().engine)
    choice = json.loads(sqlite3.connect(job.database_path).execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])
    engine = choice["engines"][0]
    assert len(engine["replicas"]) == 2
    if decided:
        assert engine["driver_bytecode_cache"]["pruned"] == ["/c/pycache/old"]
    else:
        assert "driver_bytecode_cache" not in engine


@pytest.mark.parametrize("ray_cfg, expected", [
    ({"replicas": 2, "gpus_per_replica": 1}, "ray.replicas: 2 x ray.gpus_per_replica 1 = 2 GPUs, but this machine's "
                                             "Ray cluster has 0 (set ray.gpus_per_replica: 0 for replicas on the CPU"),
    ({"replicas": 1, "gpus_per_replica": 0, "cpus_per_replica": 3, "local_num_cpus": 2},
     "ray.replicas: 1 x ray.cpus_per_replica 3 = 3 CPUs, but this machine's Ray cluster has 2 (raise ray.local_num_cpus"),
])
def test_replicas_a_local_cluster_cannot_place_stop_the_run_instead_of_waiting_for_ever(make_job, ray_cfg, expected):
    """Ray keeps an actor that asks for a GPU the machine lacks pending: the run waited without a
    word (and, blocked in ray.get, ignored SIGTERM)."""
    import shutil as _shutil

    if ray_cfg.get("gpus_per_replica") and _shutil.which("nvidia-smi"):
        pytest.skip("this machine may have GPUs")
    job = make_job(rows=6, job={"ray": ray_cfg})
    short = Path(tempfile.mkdtemp(dir="/tmp"))  # Ray's socket paths must fit 107 bytes
    try:
        rc, out, err = run_bounded(["run", "--engine", "fake", "--executor", "ray", "--quiet", job], timeout_s=300,
                                   tmpdir=short)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert rc == 5 and len(lines) == 1 and lines[0].startswith(f"Error: {expected}"), err[-2000:]


def test_a_wait_for_a_replica_is_cut_into_polls_so_a_signal_ends_it():
    """A ray.get blocked in Ray's C++ core runs no Python signal handler: SIGTERM did not stop a
    run waiting for a replica. Every wait is bounded, and the call's value still comes back."""
    import types

    from runner.engines.ray_cluster import RayCluster

    class Timeout(Exception):
        pass

    timeouts = []

    def get(call, timeout=None):
        timeouts.append(timeout)
        if len(timeouts) < 3:
            raise Timeout()
        return call * 2

    def wait(calls, num_returns=1, timeout=None):
        timeouts.append(timeout)
        return (calls[:1], calls[1:]) if len(timeouts) > 5 else ([], calls)

    cluster = object.__new__(RayCluster)
    cluster.ray = types.SimpleNamespace(get=get, wait=wait, exceptions=types.SimpleNamespace(GetTimeoutError=Timeout))
    assert cluster.get(21) == 42
    assert cluster.wait(["a", "b"]) == ["a"]
    assert len(timeouts) == 6 and all(t is not None and 0 < t <= 1 for t in timeouts)
