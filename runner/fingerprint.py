"""Fingerprints: short hashes of what decides a measurement, so that it is reused only while they hold.

A stored speculative-decoding calibration is keyed by the model, the engine's settings, the vLLM
version, the device, the vLLM settings set in the environment, the schema, the sampling and the
set of system prompts: change any one and the runner measures again.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from functools import lru_cache
from typing import Any, Iterable, Optional

from runner.engines.vllm_settings import vllm_version
from runner.models import model_fingerprint


def digest(value: Any) -> str:
    """sha256 of a JSON-able value, written canonically (sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@lru_cache(maxsize=1)
def device_name() -> str:
    """The accelerator the engine will run on, or the CPU model. Asked of nvidia-smi rather than
    torch: a CUDA context in this process would take GPU memory from vLLM's KV cache."""
    smi = shutil.which("nvidia-smi")
    if smi:
        cmd = [smi, "--query-gpu=name", "--format=csv,noheader"]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            cmd += ["-i", visible]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.split("\n")
            names = [n.strip() for n in out if n.strip()]
            if names:
                return f"{len(names)}x {names[0]}"
        except (OSError, subprocess.SubprocessError):
            pass
    return cpu_name()


@lru_cache(maxsize=1)
def cpu_name() -> str:
    """The host's CPU model and core count (what CPU-side work, such as token masks, runs on)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu {model} x{os.cpu_count()}"


def prompt_set_fingerprint(user_template: str, system_prompt_keys: Iterable[str],
                           single_prompt: Optional[str]) -> str:
    """The set of prompts a job's rows are built from (not the documents, which change nightly)."""
    keys = sorted(system_prompt_keys) or [hashlib.sha256((single_prompt or "").encode()).hexdigest()[:12]]
    return digest({"user_template": user_template, "system_prompts": keys})[:16]


def grammar_backend(job) -> str:
    """The guided-decoding backend the job's engines run: `measure` resolved (cached; see
    runner/engines/grammar_choice.py). The backends cost differently: the calibration key depends
    on it."""
    from runner.engines.vllm_settings import resolve_grammar

    return resolve_grammar(job.engine, job.model_path, job.output_schema)[0].structured_output_backend


# vLLM settings read from the environment instead of its arguments that change how fast the engine
# runs: graphs without torch.compile (VLLM_USE_BREAKABLE_CUDAGRAPH: 1.16-1.19x slower in wall on an
# H200 at 7e360a5), no compile, the model runner, the sampler, the CPU build's cache and threads.
ENGINE_ENVIRONMENT = ("VLLM_USE_BREAKABLE_CUDAGRAPH", "TORCH_COMPILE_DISABLE", "VLLM_USE_V2_MODEL_RUNNER",
                      "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")


def engine_environment(job, environ: Optional[dict] = None) -> dict[str, str]:
    """The ENGINE_ENVIRONMENT variables the job's engines run with: this process's; for the `ray`
    executor the job's `ray.env` over them (a local cluster's workers inherit this process's
    environment), or `ray.env` alone on a cluster elsewhere (ray.address, RAY_ADDRESS)."""
    env = dict(os.environ if environ is None else environ)
    if job.spec.executor == "ray":
        remote = (job.spec.ray.address or env.get("RAY_ADDRESS") or "local") != "local"
        env = ({} if remote else env) | job.spec.ray.env
    return {k: env[k] for k in ENGINE_ENVIRONMENT if k in env}


def calibration_key(job, system_prompt_keys: Iterable[str], backend: str = "vllm") -> dict:
    """What decides the best speculative setting for a job (see runner/engines/calibrate.py).
    `backend`: the engine that runs it; another than vLLM (the fake engine of tests and `--engine
    fake`) keys its choices apart, so that they never pass for vLLM's in the job's database."""
    # Admission waves only pace when requests go in, and the token masks' threads and pinned memory
    # only speed vLLM's steps (outputs are the same): a stored choice stays good with them on or off;
    # so does one reused with or without its slice's output lengths (they only seed admission).
    # The usage feedback counts like kv_pacing, but only when on: at its default (off) it leaves the
    # keys stored before it existed as they were.
    engine = job.engine.model_dump(mode="json", exclude={
        "speculative", "in_process", "admission_waves", "kv_lengths_from_calibration", "grammar_threads_from",
        "grammar_mask_pinned"})
    if not engine["kv_usage_feedback"]:
        del engine["kv_usage_feedback"]
    # The CUDA graph sizes vLLM gets, only where it gets some: keys stored before the setting existed
    # (and the calibrations and verifications under them) stay valid for engines without it.
    engine["cuda_graph_sizes"] = job.engine.graph_sizes()
    if engine["cuda_graph_sizes"] is None:
        del engine["cuda_graph_sizes"]
    engine["structured_output_backend"] = grammar_backend(job)
    # Only where one is set: keys stored before (and the choices under them) stay valid without.
    if environment := engine_environment(job):
        engine["environment"] = environment
    sampling = {k: v for k, v in job.spec.sampling.fingerprint_dump().items()
                if k not in ("retry_max_tokens", "retry_repetition_penalty")}
    key = {
        "model": str(job.model_path),
        "model_fingerprint": model_fingerprint(job.model_path),
        "engine": engine,
        "vllm": vllm_version(),
        "device": device_name(),
        "schema_sha256": digest(job.output_schema)[:16],
        "sampling": sampling,
        "prompt_set": prompt_set_fingerprint(job.spec.prompts.user_template, system_prompt_keys,
                                             job.system_prompt or job.spec.prompts.system_template),
    }
    if backend != "vllm":  # only then: keys stored for vLLM stay as they were
        key["backend"] = backend
    return key


# The engine settings a verification is keyed by: what the model computes from (the weights' type
# and source, the guided-decoding backend, vLLM's other arguments, the split across GPUs). Scheduling
# (batch sizes, the KV cache, admission, graphs), the length and the sampling are left out: a smoke
# run with `--set engine.max_num_seqs=8` or another max_tokens is bound by the verdict on the job's
# drafts. They are kept in `verification_settings`, which decides whether a later pass lifts a failure.
VERIFIED_ENGINE = ("dtype", "load_format", "structured_output_backend", "extra_args", "tensor_parallel_size")


def verification_keys(key: dict) -> list[str]:
    """The digests a verification is stored under (the first) and looked up by (all, with the job's
    name), from a calibration key: the model, VERIFIED_ENGINE, vLLM, the device's model (not how
    many are visible), the schema. Left out: the prompt set, which a run over part of the input
    (`--limit`) or a night whose rows bring another system prompt changes, and what `VERIFIED_ENGINE`
    says. The others are the keys verifications were stored under by earlier versions: the
    calibration key less `verify` and `calibration`, then the whole key (they bind only runs with
    the prompts and settings they were made with)."""
    engine = key.get("engine", {})
    verified = {k: v for k, v in key.items() if k not in ("prompt_set", "engine", "sampling", "device")}
    verified |= {"engine": {k: engine[k] for k in VERIFIED_ENGINE if k in engine},
                 "device": re.sub(r"^\d+x | x\d+$", "", key.get("device", ""))}
    return [digest(verified), digest(_measured(key)), digest(key)]


def verification_settings(key: dict) -> str:
    """What a verification ran with besides its key and prompts (scheduling, sampling, the GPUs
    seen): a failure is lifted only by a later pass made with the same, over as many rows."""
    return digest({k: v for k, v in _measured(key).items() if k != "prompt_set"})[:16]


def _measured(key: dict) -> dict:
    """A calibration key less its `verify` and `calibration` sections (how to measure)."""
    return key | {"engine": {k: v for k, v in key.get("engine", {}).items() if k not in ("verify", "calibration")}}


def prompt_keys(job, scan) -> set[str]:
    """The system prompts of the job's whole input, for the calibration key's prompt set: the
    scan's, or for `speculative: auto` where a row limit cut the scan short (`--limit`), from a pass
    over the system prompt column alone, so that a smoke run keys its choice as the whole run does.
    Where that column cannot be read past the limit, the scan's (the smoke run measures its own)."""
    spec = job.spec.input
    if not scan.cut_by_limit or not spec.system_prompt_column or job.engine.speculative != "auto":
        return scan.system_prompt_keys
    from runner.errors import InputError
    from runner.inputs import system_prompt_keys
    from runner.readers import LocalReader

    try:
        return system_prompt_keys(LocalReader(job.input_path, spec.model_copy(update={"limit": None})))
    except InputError:
        return scan.system_prompt_keys


def result_fingerprint(job) -> tuple[str, dict]:
    """(fingerprint, components) of what makes a job's results: the model and its chat template,
    the prompts, the schema, the sampling, the prompt-length rule, the speculative setting as
    configured (drafts can change greedy outputs), the guided-decoding backend when a config names
    one other than xgrammar. The documents are the rows' own data."""
    files = {}
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        f = job.model_path / name
        files[name] = hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else None
    spec = job.spec
    components = {
        "model": model_fingerprint(job.model_path),
        "chat_template": files,
        "engine": job.engine.model_dump(mode="json", include={"dtype", "load_format", "max_model_len", "speculative"}),
        "prompts": spec.prompts.fingerprint_dump()
        | {"system_sha256": hashlib.sha256(job.system_prompt.encode()).hexdigest()[:16] if job.system_prompt else None}
        | ({"chat_template_sha256": digest(job.chat_template)[:16]} if job.chat_template else {}),
        "output_schema": digest(job.output_schema)[:16],
        "sampling": spec.sampling.fingerprint_dump(),
        "on_too_long": spec.input.on_too_long,
    }
    grammar = job.engine.structured_output_backend  # as configured, like `speculative: auto`: a choice
    if grammar not in ("xgrammar", "measure"):      # measured per machine must not redo a job's rows
        components["grammar"] = grammar             # (xgrammar: what earlier versions ran; rows stay)
    return digest(components)[:16], components


def changed_parts(old: dict, new: dict) -> list[str]:
    """Dotted names of the components that differ, e.g. ['output_schema', 'sampling.max_tokens']."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{k}" for k in changed_parts(a, b)]
        else:
            out.append(key)
    return out
