"""Generation backends behind one seam (see base.Engine)."""
from __future__ import annotations

from typing import Optional

from runner.engines.base import Completion, Engine, EngineCounters, EngineInfo, Request

__all__ = ["Completion", "Engine", "EngineCounters", "EngineInfo", "Request", "build_engine", "build_local_engine",
           "describe_settings", "preload"]


def preload(job, kind: str = "vllm") -> None:
    """Start importing the engine's library in a thread now (vLLM's import takes seconds), so that
    it overlaps with checking the input and opening the database instead of delaying the engine."""
    if kind != "vllm":
        return
    import os
    import threading

    from runner.bytecode import engine_bytecode
    from runner.engines.vllm_settings import offline_environment

    os.environ.update(offline_environment(job.engine.in_process))  # read when vLLM is imported
    engine_bytecode()  # before the import: where torch and vLLM have no bytecode, it is kept

    def load() -> None:
        import importlib

        try:
            importlib.import_module("vllm.entrypoints.llm")  # what `from vllm import LLM` loads
        except Exception:  # the engine's own import reports it, as an EngineError
            pass

    threading.Thread(target=load, name="runner-preload", daemon=True).start()


def describe_settings(backend: Optional[str], settings: dict) -> list[tuple[str, str]]:
    """The engine settings worth showing in a report, from a run's stored backend and settings."""
    if backend and backend.startswith("vllm"):
        from runner.engines.vllm_settings import describe

        return describe(settings)
    return []


def build_local_engine(job, kind: str = "vllm") -> Engine:
    """One engine in this process: `vllm`, or `fake` (tests of the runner's own logic)."""
    if kind == "fake":
        import os

        from runner.engines.fake import FakeEngine

        # RUNNER_FAKE_DELAY_S slows the fake engine down so that tests can kill a run midway;
        # RUNNER_FAKE_CLOSE_S makes its shutdown hang that long.
        delay = float(os.environ.get("RUNNER_FAKE_DELAY_S", "0"))
        return FakeEngine(job.output_schema, block_tokens=job.block_tokens, delay_s=delay, record=False,
                          close_s=float(os.environ.get("RUNNER_FAKE_CLOSE_S", "0")))
    from runner.engines.vllm_engine import VllmEngine

    return VllmEngine(job.engine, job.model_path, job.spec.sampling, job.output_schema)


def build_engine(job, kind: str = "vllm") -> Engine:
    """The engine a job runs on: one in this process, or replicas of it on Ray (`executor: ray`)."""
    if job.spec.executor == "ray":
        import functools

        from runner.engines.ray import RayEngine

        return RayEngine(job, functools.partial(build_local_engine, kind=kind))
    return build_local_engine(job, kind)
