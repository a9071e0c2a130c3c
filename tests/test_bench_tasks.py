"""bench/tasks.py: what a benchmark run records from vLLM's own log."""
import sqlite3
from pathlib import Path

from bench.tasks import log_samples

LOG = """INFO 11-30 17:40:01 [core.py:340] init engine took 10.30 s
(EngineCore pid=5570) INFO 11-30 17:40:09 [loggers.py:259] Engine 000: Avg prompt throughput: 14885.5 tokens/s, \
Avg generation throughput: 5612.3 tokens/s, Running: 42 reqs, Waiting: 0 reqs, GPU KV cache usage: 81.5%, \
Prefix cache hit rate: 80.4%
INFO 11-30 17:40:14 [loggers.py:259] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: \
2489.8 tokens/s, Running: 12 reqs, Waiting: 3 reqs, Deferred: 1 reqs, GPU KV cache usage: 100.0%, Prefix cache hit rate: 3.7%
"""


def test_log_samples_reads_running_requests_and_kv_usage_from_every_stats_line():
    assert log_samples(LOG) == {"vllm_log_running": [42, 12], "vllm_log_kv_usage": [0.815, 1.0]}
    assert log_samples("no stats here") == {"vllm_log_running": [], "vllm_log_kv_usage": []}


def test_engine_set_and_a_named_grammar_backend_reach_the_runners_job(tmp_path, tiny_model_dir):
    """--engine-set applies to every runner configuration; `xgrammar`/`guidance` name the backend
    where `runner` keeps the config's `measure`."""
    import argparse

    import yaml

    from bench.tasks import Task, runner_command

    a = argparse.Namespace(workdir=str(tmp_path), docs=8, multi_docs=8, model=str(tiny_model_dir), platform="cpu",
                           tight_blocks=64, tight_blocks_8b=64, engine_set=["enforce_eager=true", "max_num_seqs=16"])
    engines = {}
    for config in ("runner", "guidance", "vllmgraphs", "nocompile_dec"):
        d = tmp_path / config
        d.mkdir()
        runner_command(a, Task("invoices/tight/135m", config, 1), d, {})
        engines[config] = yaml.safe_load((d / "job.yaml").read_text())["engine"]
    assert engines["runner"]["enforce_eager"] is True and engines["guidance"]["max_num_seqs"] == 16
    assert "structured_output_backend" not in engines["runner"]  # the config file's: measure
    assert engines["guidance"]["structured_output_backend"] == "guidance"
    assert "cuda_graph_sizes" not in engines["runner"] and engines["vllmgraphs"]["cuda_graph_sizes"] is None
    assert engines["nocompile_dec"]["extra_args"]["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert "extra_args" not in engines["runner"]


def test_runs_share_a_compile_key_exactly_when_they_ask_vllm_for_the_same_cuda_graphs():
    """The graph sizes are in vLLM's compile hash: plain vLLM and vllmgraphs run vLLM's own list;
    the runner, its other variants and fewgraphs the GPU config's; first compiles of one list wait
    for each other, those of different lists do not."""
    from bench.tasks import Task

    def key(config, model="135m"):
        return Task(f"invoices/tight/{model}", config, 1).compile_key

    assert key("plain") == key("sorted") == key("vllmgraphs") != key("runner")
    assert key("runner") == key("fewgraphs") == key("nowave") == key("runner_first")
    assert key("runner", "8b") != key("runner")
    assert key("biggraphs") not in (key("runner"), key("plain"))  # its own, longer list


def test_a_misspelt_configuration_stops_the_benchmark_before_it_starts(tmp_path):
    import argparse

    import pytest

    from bench.tasks import make_tasks

    a = argparse.Namespace(cases="invoices/tight/135m=plain,runner,fewgrahps", multi="", repeats=2, multi_repeats=1)
    with pytest.raises(KeyError, match="fewgrahps"):
        make_tasks(a)
    a.cases = "invoices/tight/135m=plain,runner,fewgraphs"
    # round 2 starts one configuration later: none always runs right after the same one
    assert [t.config for t in make_tasks(a)] == ["plain", "runner", "fewgraphs", "runner", "fewgraphs", "plain"]
    for case in ("invoices/tigth/135m", "invoice/tight/135m", "invoices/tight/7b", "invoices/tight"):
        a.cases = f"{case}=plain"
        with pytest.raises(KeyError, match="WORKLOAD/REGIME/MODEL"):
            make_tasks(a)
    import bench.tasks
    from runner.errors import SpecError

    def refused(config):
        raise SpecError("smollm2-h200.yaml: extra_args: Value error, compilation_config.cudagraph_mode FULL ...")

    with pytest.MonkeyPatch.context() as mp:  # a variant the runner would refuse fails here, not on the GPU
        mp.setattr(bench.tasks, "graph_sizes", refused)
        a.cases = "invoices/tight/135m=plain,runner"
        with pytest.raises(KeyError, match="'runner': the runner refuses its settings: .*cudagraph_mode FULL"):
            make_tasks(a)
    for cases in ("invoices/tight/135m", "invoices/tight/135m=runner@x", "invoices/tight/135m="):
        a.cases = cases
        with pytest.raises(KeyError, match="expected WORKLOAD/REGIME/MODEL=CONFIG"):
            make_tasks(a)


def test_breakable_alone_adds_vllms_breakable_graphs_to_its_process(tmp_path, monkeypatch, tiny_model_dir):
    """breakable (and bigbreakable) is the GPU config run with VLLM_USE_BREAKABLE_CUDAGRAPH=1 (piecewise graphs
    without torch.compile); no other configuration's process gets the variable."""
    import argparse
    import subprocess

    import bench.tasks as tasks

    seen = {}

    def fake_run(cmd, env=None, **kw):  # the process is not started: only what it would get counts
        seen[cmd[-1]] = env
        return subprocess.CompletedProcess(cmd, 1, stdout="")

    monkeypatch.setattr(tasks, "run_group", fake_run)
    a = argparse.Namespace(workdir=str(tmp_path), docs=8, multi_docs=8, model=str(tiny_model_dir), platform="cpu",
                           tight_blocks=64, tight_blocks_8b=64, engine_set=[], task_timeout=5)
    for config in ("runner", "breakable", "bigbreakable", "nobytecode"):
        r = tasks.execute(a, tasks.Task("invoices/tight/135m", config, 1), {}, {"PATH": "/bin"})
        assert r["rc"] == 1
    envs = {Path(k).parent.name: v for k, v in seen.items()}
    assert envs["invoices-tight-135m-breakable-r1"]["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "1"
    assert envs["invoices-tight-135m-bigbreakable-r1"]["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "1"
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH" not in envs["invoices-tight-135m-runner-r1"]
    # nobytecode: the runner without its bytecode cache (runner/bytecode.py), and only it
    assert envs["invoices-tight-135m-nobytecode-r1"]["RUNNER_BYTECODE_CACHE"] == "0"
    assert all("RUNNER_BYTECODE_CACHE" not in e for k, e in envs.items() if "nobytecode" not in k)
    assert all(e["PATH"] == "/bin" for e in envs.values())


def test_a_configuration_that_calibrated_anew_keeps_its_own_seed_once(tmp_path):
    """A first run's calibration seeds its case; a configuration whose calibration key differs
    (calibration_id: it calibrated, not reused) keeps its own, once; a reused one keeps nothing.
    A seed holds calibrations only."""
    import argparse
    import sqlite3

    from bench.tasks import Task, remember_seed

    a = argparse.Namespace(workdir=str(tmp_path))

    def run_dir(name, calibrations):
        d = tmp_path / name
        d.mkdir()
        con = sqlite3.connect(d / "results.sqlite")
        for table in ("results", "run_samples", "run_stats", "runs", "calibrations"):
            con.execute(f"CREATE TABLE {table} (x)")
            con.execute(f"INSERT INTO {table} VALUES ('{name}')")
        con.commit()
        con.close()
        return d

    def rows(path, table):
        con = sqlite3.connect(path)
        try:
            return [r[0] for r in con.execute(f"SELECT x FROM {table}")]
        finally:
            con.close()

    seeds, case = {}, "invoices/tight/135m"
    remember_seed(a, Task(case, "runner", 1), {"calibration": {"reused_calibration_id": 1}}, run_dir("r0", 1), seeds)
    assert seeds == {}  # nothing to reuse yet, and it calibrated nothing of its own
    remember_seed(a, Task(case, "runner_first", 1), {"calibration": {"calibration_id": 1}}, run_dir("first", 1), seeds)
    remember_seed(a, Task(case, "runner", 2), {"calibration": {"reused_calibration_id": 1}}, run_dir("r2", 1), seeds)
    remember_seed(a, Task(case, "fewgraphs", 1), {"calibration": {"calibration_id": 2}}, run_dir("few1", 2), seeds)
    remember_seed(a, Task(case, "fewgraphs", 2), {"calibration": {"calibration_id": 3}}, run_dir("few2", 3), seeds)
    assert set(seeds) == {case, (case, "fewgraphs")}
    assert rows(seeds[case], "calibrations") == ["first"] and rows(seeds[(case, "fewgraphs")], "calibrations") == ["few1"]
    assert rows(seeds[case], "results") == [] and rows(seeds[case], "runs") == []
    assert not list(tmp_path.glob("*.part"))


def test_a_configuration_starts_from_its_own_seed_else_from_the_first_runs(tmp_path, tiny_model_dir):
    """A configuration whose calibration key differs from the first run's (fewgraphs: its graph
    sizes are in the key) reuses the calibration its own earlier round stored, else the first run's."""
    import argparse

    from bench.tasks import Task, runner_command

    a = argparse.Namespace(workdir=str(tmp_path), docs=8, multi_docs=8, model=str(tiny_model_dir), platform="cpu",
                           tight_blocks=64, tight_blocks_8b=64, engine_set=[])
    first, own = tmp_path / "first.sqlite", tmp_path / "own.sqlite"
    first.write_bytes(b"first")
    own.write_bytes(b"own")
    copied = {}
    for config, seeds in (("runner", {"invoices/tight/135m": first}),
                          ("fewgraphs", {"invoices/tight/135m": first}),
                          ("fewgraphs2", {"invoices/tight/135m": first, ("invoices/tight/135m", "fewgraphs"): own})):
        d = tmp_path / config
        d.mkdir()
        runner_command(a, Task("invoices/tight/135m", config.rstrip("2"), 2), d, seeds)
        copied[config] = (d / "results.sqlite").read_bytes()
    assert copied == {"runner": b"first", "fewgraphs": b"first", "fewgraphs2": b"own"}


def test_a_runner_runs_record_counts_vllms_finish_reasons_beside_its_valid_rows(make_job):
    """A faster engine setting must not change outputs: each run's record counts its rows by vLLM's
    finish reason (an `error` is a token the grammar forbade), read from the job's own database."""
    from click.testing import CliRunner

    from bench.tasks import runner_result
    from runner.cli import cli

    job = make_job(rows=12)
    assert CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)]).exit_code == 0
    db = job.parent / "out" / "results.sqlite"
    con = sqlite3.connect(db)
    con.execute("UPDATE results SET finish_reason = 'error', status = 'invalid_json' WHERE row_id IN "
                "(SELECT row_id FROM results ORDER BY row_id LIMIT 3)")
    con.commit()
    con.close()
    r = runner_result(db.parent)
    assert r["rows"] == 12 and r["rows_valid"] == 9
    assert r["finish_reasons"] == {"stop": 9, "error": 3}


def test_a_dry_run_checks_the_plan_and_runs_nothing(tmp_path):
    """bench/gpu.sh checks both lists with --dry-run before its warm-up spends GPU time."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    def dry(cases):
        return subprocess.run([sys.executable, str(ROOT / "bench" / "bench.py"), "--model", str(tmp_path), "--multi", "",
                               "--cases", cases, "--workdir", str(tmp_path / "rb"), "--dry-run"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)

    ok = dry("invoices/tight/135m=runner_first@1;invoices/tight/135m=plain,sorted,runner,breakable")
    assert ok.returncode == 0 and "13 runs planned" in ok.stderr
    bad = dry("invoices/tight/135m=plain,runer")
    assert bad.returncode == 1 and "Error: configuration 'runer'" in bad.stderr
    assert not (tmp_path / "rb").exists()


def test_a_finished_runs_line_shows_its_outputs_beside_its_speed():
    from bench.schedule import _outcome

    line = _outcome({"process_s": 44.29, "documents_per_s": 76.69, "rows": 1024, "rows_valid": 700,
                     "finish_reasons": {"stop": 705, "length": 302, "error": 17}})
    assert line == "44.3 s, 76.7 doc/s, 700/1024 valid (error 17, length 302, stop 705)"
    assert _outcome({"error": "Traceback\nEngineError: no GPU\n", "rc": 1}) == "ERROR EngineError: no GPU"


def test_the_cache_diagnostic_counts_a_runs_new_files_by_their_cache_folder(tmp_path, monkeypatch):
    from bench import caches

    vllm_cache, triton = tmp_path / "vllm", tmp_path / "triton"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(vllm_cache))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    old = vllm_cache / "torch_compile_cache" / "aaa" / "rank_0_0"
    old.mkdir(parents=True)
    (old / "graph").write_text("x")
    before = caches.snapshot()
    (old / "graph2").write_text("x")  # the same compile key, one more file
    for i in range(3):  # a kernel cache that a run filled
        (triton / f"k{i}").mkdir(parents=True)
        (triton / f"k{i}" / "kernel.cubin").write_text("x")
    got = caches.added(before, caches.snapshot())
    assert got == {str(old): 1, str(triton / "k0"): 1, str(triton / "k1"): 1, str(triton / "k2"): 1}
    assert caches.added(before, before) == {}


def test_the_8b_shapes_folder_is_the_same_for_the_warm_up_and_the_measured_rounds(tmp_path, model_dir):
    """vLLM's compile-cache key holds the model's path: a folder per workdir made every round-1 run
    of the 8B compile again after its warm-up had compiled (the lease of 04253d4)."""
    import json
    from types import SimpleNamespace

    from bench.tasks import Task, model_dir as task_model_dir

    source = tmp_path / "smollm2"
    source.symlink_to(model_dir)

    def folder(workdir, case):
        return task_model_dir(SimpleNamespace(model=str(source), workdir=str(tmp_path / workdir)),
                              Task(case, "runner", 1))

    warmup, measured = folder("rbw", "invoices/tight/8b"), folder("rb", "invoices/tight/8b")
    assert warmup == measured and not warmup.is_relative_to(tmp_path / "rbw")
    assert json.loads((warmup / "config.json").read_text())["hidden_size"] == 4096
    assert folder("rb", "invoices/tight/135m") == source


class _Plan:
    """A benchmark Schedule on two GPUs where nothing runs: the test finishes tasks itself and
    records which runs are active after each step."""

    def __init__(self, tasks):
        import argparse

        from bench.schedule import Schedule

        held = self.held = {}

        class Recorded(Schedule):
            def work(self, t, ids):
                held[t.config, t.round] = ids

        self.s = Recorded(argparse.Namespace(gpus="0,1", platform="cpu"), tasks, on_done=lambda: None)
        self.s.warm = {t.compile_key for t in tasks}  # compiled already: runs may share the machine
        self.order = []
        self.start()

    def start(self):
        for th in self.s.start_ready():
            th.join()
        self.order.append(sorted(f"{t.config}{t.round}@{t.gpu_ids}" for t in self.s.active))

    def finish(self, config, rnd):  # a run ends (stores no calibration: a runner_first "failed")
        self.s.active.remove(next(t for t in self.s.active if (t.config, t.round) == (config, rnd)))
        self.s.free.extend(self.held[config, rnd])
        self.start()


def _tasks(configs, rounds=(1, 2), case="invoices/roomy/135m"):
    from bench.tasks import Task

    return [Task(case, c, r, gpus=2 if c == "ray2" else 1) for r in rounds for c in configs]


def test_ray_runs_have_the_machine_and_the_next_round_waits_for_the_two_gpu_run():
    """Two GPUs, rounds of plain, runner (one GPU each, side by side), ray1 and ray2: a GPU freed
    while ray2 waits for the other must not go to the next round's runs, or every ray2 would wait
    for the plan's last single-GPU run (rounds no longer interleaved); ray1 runs with no neighbour,
    as ray2 does, so that their ratio measures replicas, not neighbours."""
    plan = _Plan(_tasks(("plain", "runner", "ray1", "ray2")))
    for config, rnd in (("plain", 1), ("runner", 1), ("ray1", 1), ("ray2", 1)):
        plan.finish(config, rnd)
    assert plan.order == [["plain1@0", "runner1@1"], ["runner1@1"], ["ray11@0"], ["ray21@0,1"],
                          ["plain2@0", "runner2@1"]]
    assert plan.held["ray1", 1] == ["0", "1"]  # both held, one visible to the run


def test_a_one_gpu_ray_run_is_not_starved_by_the_next_rounds_runs():
    """ray1 alone in the multi-GPU list: it needs every GPU free at once, so the next round's
    single-GPU runs wait for it instead of taking each GPU as it frees."""
    plan = _Plan(_tasks(("plain", "runner", "ray1")))
    for config, rnd in (("plain", 1), ("runner", 1), ("ray1", 1)):
        plan.finish(config, rnd)
    assert plan.order == [["plain1@0", "runner1@1"], ["runner1@1"], ["ray11@0"], ["plain2@0", "runner2@1"]]


def test_a_failed_first_run_does_not_deadlock_the_next_rounds():
    """runner_first in every round beside ray2: when round 1's first run stores no calibration,
    ray2 of round 1 must not wait for round 2's first run, which waits for it."""
    plan = _Plan(_tasks(("runner_first", "ray2")))
    plan.finish("runner_first", 1)
    assert [r.split("@")[0] for r in plan.order[-1]] == ["ray21"]
    plan.finish("ray2", 1)
    assert [r.split("@")[0] for r in plan.order[-1]] == ["runner_first2"]
