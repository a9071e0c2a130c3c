"""A job's engine settings checked before vLLM is imported: what vLLM would refuse only once it has
started (tokens a step, the model's length, sampling fields it does not have), refused while the
job loads, naming the file and the field that set it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.engine_config import EngineConfig, SpeculativeSpec
from runner.errors import SpecError

if TYPE_CHECKING:
    from runner.spec import JobFile


class EngineSettingSource:
    """`FILE: field` of where an engine setting of a job came from: the job (or --set), its engine
    config file, or neither (vLLM's default, as the runner passes it)."""

    def __init__(self, job_engine: dict[str, Any], engine: EngineConfig, cfg_path: Path, job_path: Path):
        self.job_engine, self.engine, self.cfg_path, self.job_path = job_engine, engine, cfg_path, job_path

    def file(self, field: str) -> Path:
        """The job file where it sets the field, else the engine config file (also for a default)."""
        return self.job_path if self._in_job(field) else self.cfg_path

    def __call__(self, field: str) -> str:
        """`field` may be a path into a section (speculative.prompt_lookup_max, calibration.candidates[0]):
        sections merge key by key, so a key the job's section lacks is the engine config's."""
        if self._in_job(field):
            return f"{self.job_path}: engine.{field}"
        if field.split(".")[0].split("[")[0] in self.engine.model_fields_set:
            return f"{self.cfg_path}: {field}"
        return f"{self.cfg_path}: {field} (not set: the default)"

    def _in_job(self, field: str) -> bool:
        node: Any = self.job_engine
        for part in field.replace("[", ".[").split("."):
            if part.startswith("["):  # inside a list: lists are replaced whole, so it is the list's file's
                return True
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True


def check_engine_settings(engine: EngineConfig, model_path: Path, spec: "JobFile", where: EngineSettingSource) -> None:
    """Settings vLLM would refuse only once imported and starting, refused while loading instead."""
    from runner.model_length import length_refusal

    why = engine.step_refusal()
    if why:
        same_file = where.file("max_num_seqs") == where.file("max_num_batched_tokens")
        seqs_from = "" if same_file else f" (max_num_seqs: {where('max_num_seqs')})"
        raise SpecError(f"{where('max_num_batched_tokens')}: {why}{seqs_from}")
    why = length_refusal(engine, model_path, os.environ | spec.ray.env)  # ray.env: what replicas get
    if why:
        raise SpecError(f"{where('max_model_len')}: {why}")
    if spec.executor == "local":  # Ray's replicas run the cluster's vLLM, which may be another version
        _check_sampling_args(spec.sampling.extra_args, where.job_path)
        _check_engine_args(engine.extra_args, where)
        _check_speculative_keys(engine, where)
        _check_load_format(engine, where)
    if spec.sampling.max_tokens >= engine.max_model_len:  # every row would be stored failed, too long
        length = where("max_model_len").removeprefix(f"{where.job_path}: ")  # its file, if not the job's
        raise SpecError(f"{where.job_path}: sampling.max_tokens: {spec.sampling.max_tokens} leaves no room for a "
                        f"prompt within max_model_len {engine.max_model_len} ({length})")


def _check_sampling_args(extra_args: dict[str, Any], job_path: Path) -> None:
    """An extra_args key the installed vLLM's SamplingParams does not have: refused now, not once
    vLLM has imported and the run is recorded failed."""
    from runner.engines.vllm_settings import sampling_fields, vllm_version

    fields = sampling_fields() if extra_args else None
    unknown = sorted(set(extra_args) - fields) if fields else []
    if unknown:
        raise SpecError(f"{job_path}: sampling.extra_args.{unknown[0]}: not a field of vllm.SamplingParams "
                        f"({vllm_version()}){_did_you_mean(unknown[0], fields)}")


def _check_load_format(engine: EngineConfig, where: EngineSettingSource) -> None:
    """A load_format the installed vLLM does not know (a typo of `dummy`): refused now, not once
    vLLM has imported and the night's run is recorded failed."""
    from runner.engines.vllm_settings import load_formats, vllm_version

    field, value = engine.load_format_setting
    known = load_formats() if isinstance(value, str) else None
    if known and value.lower() not in known:  # vLLM lowercases it
        raise SpecError(f"{where(field)}: {value!r} is not a load format of {vllm_version()} "
                        f"({', '.join(sorted(known))}){_did_you_mean(value.lower(), known)}")


def _check_engine_args(extra_args: dict[str, Any], where: EngineSettingSource) -> None:
    """An engine extra_args key the installed vLLM's LLM(...) does not take: refused now, where it
    passed validate and plan and stopped the run once vLLM had imported."""
    from runner.engines.vllm_settings import llm_arg_names, vllm_version

    names = llm_arg_names() if extra_args else None
    unknown = sorted(set(extra_args) - names) if names else []
    if unknown:
        raise SpecError(f"{where(f'extra_args.{unknown[0]}')}: not an argument of vllm.LLM ({vllm_version()})"
                        f"{_did_you_mean(unknown[0], names)}")


def _check_speculative_keys(engine: EngineConfig, where: EngineSettingSource) -> None:
    """A key of a speculative setting (passed through to vLLM's speculative_config) that the
    installed vLLM's SpeculativeConfig does not have: refused now, not once the engine starts."""
    from runner.engines.vllm_settings import speculative_fields, vllm_version

    cal = engine.calibration
    given: list[tuple[str, str]] = []
    if isinstance(engine.speculative, SpeculativeSpec):
        given += [("speculative", k) for k in engine.speculative.model_extra or {}]
    elif engine.speculative == "auto":  # calibration's settings are used only then
        given += [("calibration.ngram", k) for k in cal.ngram]
        given += [(f"calibration.candidates[{i}].options", k) for i, c in enumerate(cal.candidates or []) for k in c.options]
    fields = speculative_fields() if given else None
    # vLLM reads prompt-lookup-max as prompt_lookup_max
    unknown = [(at, k) for at, k in given if k.replace("-", "_") not in fields] if fields else []
    if unknown:
        at, key = unknown[0]
        raise SpecError(f"{where(f'{at}.{key}')}: not a key of vLLM's speculative_config ({vllm_version()})"
                        f"{_did_you_mean(key, fields)}")


def _did_you_mean(name: str, known) -> str:
    """The hint after a name vLLM would refuse: the closest known name ("; did you mean X?"), if any."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f"; did you mean {close[0]}?" if close else ""
