"""The engine part of a job: vLLM settings, speculative decoding and its calibration."""
from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, create_model, field_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # vLLM refuses them when the engine starts

    @field_validator("*", mode="before")
    @classmethod
    def _no_truth_value_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML reads yes, no, on and off as true and false, which pydantic would take as 1 and 0
        (`limit: yes` ran one row): a number field refuses them."""
        if isinstance(value, bool) and _numbers_only(cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number, not true or false (YAML reads yes, no, on and off as those)")
        return value


def _numbers_only(annotation: Any) -> bool:
    """Whether a field's type admits numbers (int, float, optionally None) and nothing else."""
    args = set(get_args(annotation)) if get_origin(annotation) in (Union, UnionType) else {annotation}
    args.discard(type(None))
    return bool(args) and args <= {int, float}


class SpeculativeSpec(BaseModel):
    """Passed through to vLLM's speculative_config; `method` is required, other keys are vLLM's."""

    model_config = ConfigDict(extra="allow")
    method: str
    num_speculative_tokens: int = Field(ge=1)


class CandidateSpec(Strict):
    """A speculative method `speculative: auto` may choose, at a draft length it measures."""

    method: str = Field(description="vLLM's speculative method: ngram, draft_model, eagle, eagle3, ...")
    model: Optional[str] = Field(default=None, description=(
        "the draft model or EAGLE head folder (relative to the config file); `distilled`: the job's "
        "latest draft made by `runner distill`"))
    max_draft_tokens: Optional[int] = Field(default=None, ge=1, description="default: calibration.max_draft_tokens")
    options: dict[str, Any] = Field(default={}, description="other speculative_config keys, e.g. prompt_lookup_max")


class VerifySpec(Strict):
    """How much a speculative setting may change greedy outputs (see `runner verify`)."""

    min_agreement: float = Field(default=0.99, ge=0, le=1, description=(
        "a setting whose stored verification agreed on fewer rows than this is not used"))
    rows: int = Field(default=64, ge=1, description="rows `runner verify` compares by default")


class CalibrationSpec(Strict):
    """How `speculative: auto` measures the job (see runner/engines/calibrate.py)."""

    rows: int = Field(default=128, ge=1, description="rows in each measured slice")
    assumed_max_speedup: float = Field(default=2.0, gt=1, description=(
        "the most drafts are assumed to speed generation up: a first run measures speculation only "
        "when the engine starts it costs are less than what this speed-up would save on the job"))
    max_draft_tokens: int = Field(default=6, ge=1)
    min_draft_tokens: int = Field(default=2, ge=1)
    max_batch: int = Field(default=256, ge=1, description=(
        "measure speculation only when the engine runs at most this many requests at once; larger "
        "batches are compute-bound and verifying drafts costs more than it saves"))
    ngram: dict[str, Any] = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    candidates: Optional[list[CandidateSpec]] = Field(default=None, description=(
        "what auto chooses among besides no drafts; default: ngram (the `ngram` settings) up to max_draft_tokens"))

    def candidate_list(self) -> list[CandidateSpec]:
        if self.candidates is not None:
            return self.candidates
        base = dict(self.ngram)
        return [CandidateSpec(method=base.pop("method", "ngram"), options=base)]


class EngineConfig(Strict):
    model: str = Field(description="model folder (relative to the config file) or builtin:NAME")
    # vLLM's ModelDType (0.26, 0.32): anything else it refuses only once imported
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    load_format: Optional[str] = Field(default=None, description=(
        "vLLM's load_format; `dummy` starts the model with random weights from its config.json "
        "alone (benchmarks of a model's shape without its weights)"))
    max_model_len: int = Field(default=2048, ge=16)
    kv_cache_memory_bytes: Optional[int] = Field(default=None, ge=1 << 20)
    gpu_memory_utilization: Optional[float] = Field(default=None, gt=0, le=1)
    num_gpu_blocks_override: Optional[int] = Field(default=None, ge=1)
    block_size: Optional[int] = Field(default=None, ge=1, description="KV block tokens; vLLM's default is 16 on GPU, 128 on CPU")
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: Optional[int] = Field(default=None, ge=16)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_sizes: Optional[list[Annotated[StrictInt, Field(ge=1)]]] = Field(default=None, min_length=1, description=(
        "batch sizes (tokens a step) vLLM captures CUDA graphs at, for an engine without drafts (its "
        "cudagraph_capture_sizes; default: vLLM's own list, 51 sizes up to 512 from a max_num_seqs of "
        "256). Sizes over twice max_num_seqs are left out, where vLLM's own list stops; an engine "
        "with drafts keeps vLLM's list, which it rounds to multiples of the draft length + 1"))
    tensor_parallel_size: int = Field(default=1, ge=1)
    in_process: bool = Field(default=False, description="run vLLM's engine core in this process")
    speculative: Union[SpeculativeSpec, Literal["auto"], None] = None
    calibration: CalibrationSpec = CalibrationSpec()
    verify: VerifySpec = VerifySpec()
    structured_output_backend: Literal["measure", "auto", "xgrammar", "guidance", "outlines"] = Field(
        default="measure", description=(
            "vLLM's guided-decoding backend; `measure`: xgrammar or guidance, whichever fills the job's "
            "token masks faster on this CPU (runner/engines/grammar_choice.py), cached per schema"))
    grammar_threads_from: Optional[int] = Field(default=16, ge=1, description=(
        "fill a step's token masks on threads once it has more guided requests than this (vLLM "
        "fills them one by one up to 128); null: vLLM's own threshold (runner/engines/grammar_masks.py)"))
    grammar_mask_pinned: bool = Field(default=True, description=(
        "fill token masks straight into pinned memory (CUDA), not into a buffer vLLM copies into "
        "fresh pinned memory every step"))
    kv_admission: bool = Field(default=True, description="admit requests only while the KV cache can hold them")
    kv_projection: bool = Field(default=True, description=(
        "admit past the sum of peak KV needs while a projection (earlier requests finish first) fits"))
    kv_pacing: bool = Field(default=True, description=(
        "where the KV cache binds and outputs are about as long, spread admissions out so that waves "
        "of requests do not finish (and peak) together"))
    kv_lengths_from_calibration: bool = Field(default=True, description=(
        "a run that reuses a stored calibration takes its admission pace from the output lengths of "
        "that calibration's slice until 16 of its own rows are done, so that it paces from its first row"))
    kv_usage_feedback: bool = Field(default=False, description=(
        "where the runner's count of KV blocks held runs above vLLM's reported usage, add the excess "
        "to the room (on an H200 it changed neither the requests in flight nor the steps: off)"))
    admission_waves: bool = Field(default=True, description=(
        "where the KV cache binds, let admissions wait to go in together when a step that prefills "
        "costs more than one that only decodes (measured while running)"))
    warm_prefix: bool = Field(default=True, description="send a group's first request alone, then the rest")
    max_in_flight: Optional[int] = Field(
        default=None, ge=1, description="requests kept queued in the engine; default 4 x max_num_seqs"
    )
    extra_args: dict[str, Any] = Field(default={}, description="other keyword arguments for vllm.LLM")

    @field_validator("extra_args")
    @classmethod
    def _no_graphs_of_mixed_steps(cls, extra: dict[str, Any]) -> dict[str, Any]:
        """cudagraph_mode FULL also captures whole-step graphs of steps that prefill and decode at
        once (FlashAttention 3 declares them supported). On an H200 with vLLM 0.26, an engine with
        that mode, no torch.compile and graphs up to 2,048 tokens a step ended rows with tokens the
        grammar forbids and wrote degenerate text (bench/results/2026-12-01-nvidia-h200-nocompile.json).
        It changed three things at once; one run without compile and with decode-only whole graphs
        at 20 sizes ended no row so, and pytorch/torchtitan#3668 found FULL at large capture sizes
        broke generation, so FULL is the likely cause. A job's results must not depend on it.
        vllm_settings.graphs_of_mixed_steps catches the settings with which vLLM chooses FULL
        itself, once the engine has started."""
        compilation = extra.get("compilation_config")
        mode = compilation.get("cudagraph_mode") if isinstance(compilation, dict) else None
        if (mode.strip().upper() if isinstance(mode, str) else mode) in ("FULL", 2):  # 2: CUDAGraphMode.FULL
            raise ValueError("compilation_config.cudagraph_mode FULL graphs steps that mix prefill and decode, "
                             "which broke outputs on vLLM 0.26 (H200): use FULL_DECODE_ONLY (FULL_AND_PIECEWISE "
                             "needs torch.compile, mode 3: with mode 0 vLLM drops CUDA graphs)")
        return extra

    def graph_sizes(self) -> Optional[list[int]]:
        """The CUDA graph sizes vLLM gets: cuda_graph_sizes up to twice max_num_seqs (vLLM's own
        list stops there: a larger one would only lengthen the start), at least the smallest; None
        for vLLM's own list: unset, no graphs (enforce_eager), or drafts (vLLM rounds the sizes to
        multiples of k + 1 and its own list reaches further; fewer sizes were measured without)."""
        if self.cuda_graph_sizes is None or self.enforce_eager or isinstance(self.speculative, SpeculativeSpec):
            return None
        sizes = sorted(set(self.cuda_graph_sizes))
        return [s for s in sizes if s <= 2 * self.max_num_seqs] or sizes[:1]

    def step_refusal(self) -> Optional[str]:
        """Why vLLM would refuse these settings' tokens a step (fewer than sequences: it says so only
        once imported, ~20 s into a run on a GPU host), or None. Asked of the settings a job runs
        with, not of a config file alone, which a job may complete; extra_args naming either
        setting is left to vLLM."""
        tokens, seqs = self.max_num_batched_tokens, self.max_num_seqs
        if tokens is None or tokens >= seqs or {"max_num_batched_tokens", "max_num_seqs"} & set(self.extra_args):
            return None
        return f"{tokens} is less than max_num_seqs ({seqs}), which vLLM refuses: raise it or lower max_num_seqs"

    @property
    def needs_weights(self) -> bool:
        """False when vLLM fills random weights (load_format: dummy), so a config-only folder loads."""
        return str(self.loaded_as or "").lower() != "dummy"  # vLLM lowercases it

    @property
    def loaded_as(self) -> Optional[str]:
        """The load_format vLLM gets."""
        return self.load_format_setting[1]

    @property
    def load_format_setting(self) -> tuple[str, Optional[str]]:
        """(the setting that gives the load_format vLLM gets, its value): extra_args' over the
        field's, since extra_args go to vLLM last."""
        if "load_format" in self.extra_args:
            return "extra_args.load_format", self.extra_args["load_format"]
        return "load_format", self.load_format


def _section(annotation: Any) -> bool:
    """Whether a field holds a section of its own (calibration, verify, speculative)."""
    args = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in args)


# Every EngineConfig field, optional: what a job may override. A section may be partial (only
# calibration.rows): it is checked once merged onto the engine config's (merge_engine).
EngineOverrides = create_model(
    "EngineOverrides",
    __base__=Strict,
    config=(str, ...),
    **{name: (Optional[Any] if _section(f.annotation) else Optional[f.annotation], None)
       for name, f in EngineConfig.model_fields.items()},
)


def merge_engine(config: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """The engine config's settings with the job's (and --set's) on top, key by key inside sections
    (calibration, speculative, extra_args): `--set engine.calibration.rows=16` keeps the config's
    other calibration settings. A speculative setting that names its `method` replaces the config's
    whole, as it always did: another method's keys would not apply to it, and a job that gives a
    whole setting keeps the results (and fingerprints) it had."""
    out = dict(config)
    for key, value in job.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict) and "method" not in value:
            out[key] = merge_engine(old, value)
        else:
            out[key] = value
    return out
