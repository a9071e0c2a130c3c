"""Typed job specification: the YAML job file, its engine config and its output schema.

Raw dicts stop here: `load_job(path)` returns a `Job` whose paths are resolved and whose schema
is loaded and checked. Every problem becomes one SpecError naming the file and the field.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from runner.engine_checks import EngineSettingSource, check_engine_settings
from runner.engine_config import EngineConfig, EngineOverrides, Strict, merge_engine
from runner.errors import InputError, ModelError, SpecError
from runner.overrides import apply_overrides
from runner.prompt_spec import PromptSpec, load_prompts
from runner.sampling_spec import SamplingSpec
from runner.schema_file import check_examples, load_schema
from runner.spec_files import format_validation_error, read_yaml, resolve_relative


class InputSpec(Strict):
    path: str = Field(description="a file, folder or glob, relative to the job file")
    format: Optional[Literal["parquet", "jsonl", "csv", "openai-batch"]] = Field(default=None, description=(
        "default: from each file's ending; openai-batch reads vLLM run_batch files (columns custom_id, system, user)"))
    id_column: str
    text_column: str
    system_prompt_column: Optional[str] = None
    extra_columns: list[str] = []
    limit: Optional[int] = Field(default=None, ge=1)
    batch_rows: int = Field(default=1024, ge=1, description="rows per Parquet record batch read")
    on_too_long: Literal["fail", "truncate"] = "fail"
    on_bad_row: Literal["fail", "store"] = Field(default="fail", description=(
        "fail: a null or duplicate id, or a null text, stops the run before it starts; store: such a "
        "row is recorded (failed, or in rejected_rows) and the run goes on; duplicates keep the first"))

    @field_validator("extra_columns")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        twice = sorted({c for c in v if v.count(c) > 1})
        if twice:  # a second copy would be a second column of the same name in exports and reports
            raise ValueError(f"{', '.join(map(repr, twice))} listed more than once")
        return v

    def columns(self) -> list[tuple[str, str]]:
        """(column, the job field that names it) of every column a run reads: the one list."""
        cols = [(self.id_column, "input.id_column"), (self.text_column, "input.text_column")]
        if self.system_prompt_column:
            cols.append((self.system_prompt_column, "input.system_prompt_column"))
        named = {c for c, _ in cols}
        return cols + [(c, "input.extra_columns") for c in self.extra_columns if c not in named]

    def column_names(self) -> list[str]:
        return [c for c, _ in self.columns()]


class OutputSpec(Strict):
    database: str
    commit_every_rows: int = Field(default=64, ge=1)
    max_failed_fraction: float = Field(default=0.05, ge=0, le=1, description=(
        "a run that ends with more of its input's rows not ok than this exits 65, so that cron notices"))


class RaySpec(Strict):
    """Where and how the `ray` executor runs engine replicas."""

    address: Optional[str] = Field(default=None, description="Ray cluster address; default RAY_ADDRESS, else a local cluster")
    replicas: int = Field(default=1, ge=1)
    gpus_per_replica: float = Field(default=1, ge=0, description="0 for CPU-only replicas")
    cpus_per_replica: float = Field(default=1, ge=0)
    local_num_cpus: Optional[int] = Field(default=None, ge=1, description="logical CPUs of a local cluster")
    object_store_memory_bytes: int = Field(default=512 << 20, ge=64 << 20)
    group_chunk_rows: int = Field(default=512, ge=1, description="rows of one group sent to a replica before it may move")
    env: dict[str, str] = Field(default={}, description="environment variables for the replicas")
    engine_in_process: bool = Field(default=False, description=(
        "replicas run vLLM's engine core in the actor's own process. In a Ray actor vLLM starts the "
        "core with spawn, which imports vLLM and torch again (CPU: a replica started in 19 s instead "
        "of 35-39 s); off by default: on an H200 it started 3 s sooner than spawned but generated at "
        "0.7x, the core's steps sharing the actor's interpreter with its feeding and collecting"))
    engine_core_start: Literal["fork", "spawn"] = Field(default="fork", description=(
        "how a replica starts vLLM's engine-core process (engine_in_process off). vLLM would spawn "
        "it in a Ray actor, importing vLLM and torch again; fork inherits the actor's imports, and "
        "is used only where vLLM would fork a local engine's core and no worker may go through Ray "
        "(one GPU, CUDA not started): on 2x H200 a run started 9-11 s sooner. "
        "VLLM_WORKER_MULTIPROC_METHOD in ray.env wins; vLLM's CPU build spawns whatever it is asked"))


class JobFile(Strict):
    """The job YAML as written; paths still relative to the job file."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    input: InputSpec
    prompts: PromptSpec = PromptSpec()
    output_schema: str
    engine: EngineOverrides  # type: ignore[valid-type]
    sampling: SamplingSpec = SamplingSpec()
    output: OutputSpec
    plan_window_rows: int = Field(default=8192, ge=1, description="rows grouped together at once")
    executor: Literal["local", "ray"] = "local"
    ray: RaySpec = RaySpec()

    @field_validator("output_schema")
    @classmethod
    def _json_file(cls, v: str) -> str:
        if not v.endswith(".json"):
            raise ValueError("must name a .json file")
        return v


class Job(BaseModel):
    """A loaded job: the validated file plus what its paths resolve to."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    path: Path
    spec: JobFile
    input_path: str
    system_prompt: Optional[str]
    chat_template: Optional[str] = None  # the text of prompts.chat_template
    schema_path: Path
    output_schema: dict[str, Any]
    engine: EngineConfig
    engine_config_path: Path
    model_path: Path
    database_path: Path

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def block_tokens(self) -> int:
        """KV block size the prefix cache works in, for the plan's bound."""
        from runner.plan import DEFAULT_BLOCK_TOKENS

        return self.engine.block_size or DEFAULT_BLOCK_TOKENS

    @property
    def system_source(self):
        """What a reader's documents() takes: the one system prompt, or prompts.system_template
        rendered with each row's fields."""
        template = self.spec.prompts.system_template
        if template is None:
            return self.system_prompt

        def render(fields: dict) -> str:
            try:
                return template.format_map(fields)
            except (ValueError, TypeError) as exc:  # a format spec that a row's value does not take
                raise InputError(f"prompt could not be built from prompts.system_template: {exc.__class__.__name__}: "
                                 f"{exc}") from None

        return render

    def snapshot(self) -> dict[str, Any]:
        """The resolved configuration, as stored with each run."""
        return {
            "job": self.spec.model_dump(mode="json"),
            "job_path": str(self.path),
            "engine": self.engine.model_dump(mode="json"),
            "model_path": str(self.model_path),
            "output_schema": self.output_schema,
            "system_prompt_sha256": _sha(self.system_prompt) if self.system_prompt else None,
        }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load_engine_config(path: Path, overrides: dict[str, Any], job_path: Path) -> EngineConfig:
    """Validate the engine config file, then the job's overrides on top of it."""
    raw = read_yaml(path)
    try:
        base = EngineConfig.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(format_validation_error(path, exc)) from None
    merged = merge_engine(base.model_dump(exclude_unset=True), overrides)
    try:
        return EngineConfig.model_validate(merged)
    except ValidationError as exc:
        raise SpecError(format_validation_error(job_path, exc, prefix="engine.")) from None


def load_job(path: str | Path, overrides: Sequence[str] = (), check_engine: bool = True,
             executor: Optional[str] = None, limit: Optional[int] = None) -> Job:
    """Load and validate a job file, its engine config and its output schema. `overrides` are
    KEY=VALUE settings from the command line (`engine.max_num_seqs=64`): they beat the job file,
    which beats the engine config file, which beats the defaults. `check_engine=False` (commands
    that only read results) skips what vLLM would refuse (the model's length, tokens a step).
    `executor` (`runner run --executor`) replaces the job's before it is checked: what the job is
    checked against (the installed vLLM, or a Ray cluster's) depends on it. `limit` (`runner run
    --limit`) is input.limit; given beside `--set input.limit=...` it is refused, not a silent winner."""
    if limit is not None and any(o.partition("=")[0].strip() == "input.limit" for o in overrides):
        raise SpecError("--limit and --set input.limit both give the input's limit: give one")
    given = " ".join([*(f"--set {o}" for o in overrides), *([f"--limit {limit}"] if limit is not None else [])])
    raw = apply_overrides(read_yaml(Path(path)), [*overrides, *([f"input.limit={limit}"] if limit is not None else [])])
    if executor:
        raw["executor"] = executor
    try:
        return _load(Path(path), raw, check_engine)
    except SpecError as exc:
        if not given:
            raise
        raise SpecError(f"{exc} (with {given})") from None


def _load(shown: Path, raw: dict[str, Any], check_engine: bool = True) -> Job:
    from runner.models import resolve_model

    job_path = shown.resolve()
    try:
        spec = JobFile.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(format_validation_error(shown, exc)) from None
    base = job_path.parent

    prompts = load_prompts(spec.prompts, base, shown, spec.input.system_prompt_column, spec.input.extra_columns,
                           spec.input.text_column)

    schema_path = resolve_relative(base, spec.output_schema)
    schema = load_schema(schema_path, str(shown))
    check_examples(spec.prompts.examples, schema, str(shown))

    overrides = spec.engine.model_dump(exclude_unset=True)
    cfg_path = resolve_relative(base, overrides.pop("config"))
    if not cfg_path.exists():
        raise SpecError(f"{shown}: engine.config: file not found: {cfg_path}")
    if cfg_path.is_dir():
        raise SpecError(f"{shown}: engine.config: {cfg_path} is a folder: name the engine config file in it")
    engine = load_engine_config(cfg_path, overrides, shown)
    try:
        # a path is relative to the file that gives it: the job (or --set: the job's folder), or the
        # config; a job's path found only beside the config is taken from there (runner 0.2.0 read it so)
        model_path = resolve_model(engine.model, cfg_path.parent)
        if "model" in overrides:
            beside_job = resolve_model(engine.model, base)
            model_path = beside_job if beside_job.exists() or not model_path.exists() else model_path
    except ModelError as exc:
        where = EngineSettingSource(overrides, engine, cfg_path, shown)
        raise ModelError(f"{where('model')}: {exc}") from None
    if check_engine:
        check_engine_settings(engine, model_path, spec, EngineSettingSource(overrides, engine, cfg_path, shown))

    return Job(
        path=job_path,
        spec=spec,
        input_path=str(resolve_relative(base, spec.input.path)),
        system_prompt=prompts.system_prompt,
        chat_template=prompts.chat_template,
        schema_path=schema_path,
        output_schema=schema,
        engine=engine,
        engine_config_path=cfg_path,
        model_path=model_path,
        database_path=resolve_relative(base, spec.output.database),
    )
