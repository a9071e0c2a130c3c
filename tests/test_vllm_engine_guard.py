"""The engine refuses to run when vLLM settled on whole CUDA graphs of steps that mix prefill and
decode (cudagraph_mode FULL), whichever setting led vLLM there. vLLM on the CPU never does (it runs
no CUDA graphs), so a stand-in vllm module plays the engine that did."""
from __future__ import annotations

import os
import sys
import types

import pytest

from runner.engine_config import EngineConfig
from runner.engines.vllm_settings import graphs_of_mixed_steps
from runner.errors import EngineError
from runner.spec import SamplingSpec


def config_with(mode_name):
    mode = None if mode_name is None else types.SimpleNamespace(name=mode_name)
    return types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=mode),
                                 cache_config=types.SimpleNamespace(num_gpu_blocks=64, block_size=16))


@pytest.mark.parametrize("name", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE", None])
def test_modes_that_graph_only_decode_steps_whole_pass(name):
    assert graphs_of_mixed_steps(config_with(name)) is None
    assert graphs_of_mixed_steps(types.SimpleNamespace()) is None  # a version without the setting


def test_an_engine_vllm_settled_on_full_graphs_is_shut_down_and_refused(tiny_model_dir, monkeypatch):
    shut = []

    class LLM:
        def __init__(self, **kw):
            self.llm_engine = types.SimpleNamespace(
                vllm_config=config_with("FULL"), engine_core=types.SimpleNamespace(shutdown=lambda: shut.append(1)))

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams, fake.__version__ = LLM, lambda **kw: kw, "0.26.0"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the engine sets vLLM's offline variables
    cfg = EngineConfig(model=str(tiny_model_dir), structured_output_backend="xgrammar",
                       extra_args={"compilation_config": {"splitting_ops": []}})  # vLLM 0.26 makes this FULL
    from runner.engines.vllm_engine import VllmEngine

    with pytest.raises(EngineError, match="resolved to compilation_config.cudagraph_mode FULL .*set cudagraph_mode FULL_DECODE_ONLY"):
        VllmEngine(cfg, tiny_model_dir, SamplingSpec(temperature=0, max_tokens=8), {"type": "object"})
    assert shut == [1]  # its engine core stopped before the error reaches the run


@pytest.mark.vllm
def test_of_vllms_own_modes_only_full_is_refused():
    modes = pytest.importorskip("vllm.config.compilation").CUDAGraphMode
    refused = {m.name for m in modes if graphs_of_mixed_steps(types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(cudagraph_mode=m)))}
    assert refused == {"FULL"} and {"FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"} <= {m.name for m in modes}


def _sleeper() -> None:
    import time

    time.sleep(600)


def test_an_engine_core_process_is_killed_and_waited_for():
    """end_core_process: the core's process (here a stand-in child) is gone, reaped, when it
    returns; an ended one and a core in this process (no processes) are left alone."""
    import multiprocessing
    import signal

    from runner.engines.vllm_settings import end_core_process

    core = multiprocessing.get_context("fork").Process(target=_sleeper, daemon=True)
    done = multiprocessing.get_context("fork").Process(target=lambda: None)
    core.start()
    done.start()
    done.join()

    def llm(procs):
        manager = types.SimpleNamespace(processes=procs)
        client = types.SimpleNamespace(resources=types.SimpleNamespace(engine_manager=manager))
        return types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=client))

    try:
        assert end_core_process(llm([core, done])) == 1
        assert not core.is_alive() and core.exitcode == -signal.SIGKILL and done.exitcode == 0
        assert end_core_process(llm([core])) == 0  # already ended
        assert end_core_process(types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=object()))) == 0
    finally:
        if core.is_alive():
            core.kill()


@pytest.mark.vllm
def test_closing_an_engine_whose_core_has_its_own_process_kills_it_and_another_starts(make_job):
    """Against vLLM: close() has ended and reaped the core's process, vLLM's own shutdown completes
    with its core already gone, and the next engine of a run starts and generates. (On this CPU
    vLLM's SIGTERM wait runs out and kills the core too, so the exit code alone does not tell the
    two apart: the test above does.)"""
    import signal

    from runner.engines import Request, build_engine
    from runner.spec import load_job

    job = load_job(make_job(rows=2, engine={"in_process": False, "speculative": None}))
    for _ in range(2):
        engine = build_engine(job)
        procs = list(engine.llm.llm_engine.engine_core.resources.engine_manager.processes)
        request = Request(row_id="r0", group_key="g", prompt_token_ids=[1, 2, 3], max_tokens=2)
        assert len(list(engine.generate([request]))) == 1
        engine.close()
        assert procs and all(not p.is_alive() and p.exitcode == -signal.SIGKILL for p in procs)
