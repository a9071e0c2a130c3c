"""bench/tasks.py: what a benchmark run records from vLLM's own log."""
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
    for config in ("runner", "guidance", "fewgraphs"):
        d = tmp_path / config
        d.mkdir()
        runner_command(a, Task("invoices/tight/135m", config, 1), d, {})
        engines[config] = yaml.safe_load((d / "job.yaml").read_text())["engine"]
    assert engines["runner"]["enforce_eager"] is True and engines["guidance"]["max_num_seqs"] == 16
    assert "structured_output_backend" not in engines["runner"]  # the config file's: measure
    assert engines["guidance"]["structured_output_backend"] == "guidance"
    graphs = engines["fewgraphs"]["extra_args"]["compilation_config"]["cudagraph_capture_sizes"]
    assert graphs[0] == 1 and graphs[-1] == 512 and graphs == sorted(set(graphs))  # vLLM's default range, fewer sizes


def test_a_configuration_with_its_own_compiled_graphs_and_calibration_waits_for_and_reuses_its_own(tmp_path, tiny_model_dir):
    """fewgraphs compiles apart from the runner (another vLLM compile hash) and, its calibration key
    differing, reuses the calibration its own earlier round stored rather than the first run's."""
    import argparse

    from bench.tasks import Task, runner_command

    assert Task("invoices/tight/135m", "fewgraphs", 1).compile_key != Task("invoices/tight/135m", "runner", 1).compile_key
    assert Task("invoices/tight/135m", "nowave", 1).compile_key == Task("invoices/tight/135m", "runner", 1).compile_key
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
