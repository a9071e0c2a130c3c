"""Generation backends behind one seam (see base.Engine)."""
from __future__ import annotations

from runner.engines.base import Completion, Engine, EngineCounters, EngineInfo, Request

__all__ = ["Completion", "Engine", "EngineCounters", "EngineInfo", "Request", "build_engine", "preload"]


def preload(job, kind: str = "vllm") -> None:
    """Start importing the engine's library in a thread now (vLLM's import takes seconds), so that
    it overlaps with checking the input and opening the database instead of delaying the engine."""
    if kind != "vllm":
        return
    import os
    import threading

    from runner.engines.vllm_settings import offline_environment

    os.environ.update(offline_environment(job.engine.in_process))  # read when vLLM is imported

    def load() -> None:
        import importlib

        try:
            importlib.import_module("vllm.entrypoints.llm")  # what `from vllm import LLM` loads
        except Exception:  # the engine's own import reports it, as an EngineError
            pass

    threading.Thread(target=load, name="runner-preload", daemon=True).start()


def build_engine(job, kind: str = "vllm") -> Engine:
    """The engine a job runs on: `vllm` (real; replicas on Ray with `executor: ray`), or `fake`
    (tests of the runner's own logic)."""
    if kind == "fake":
        import os

        from runner.engines.fake import FakeEngine

        # RUNNER_FAKE_DELAY_S slows the fake engine down so that tests can kill a run midway.
        delay = float(os.environ.get("RUNNER_FAKE_DELAY_S", "0"))
        return FakeEngine(job.output_schema, block_tokens=job.block_tokens, delay_s=delay, record=False)
    if job.spec.executor == "ray":
        from runner.ray_executor import RayEngine

        return RayEngine(job)
    from runner.engines.vllm_engine import VllmEngine

    return VllmEngine(job.engine, job.model_path, job.spec.sampling, job.output_schema)
