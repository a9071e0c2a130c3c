"""The job's `sampling:` section: vLLM's SamplingParams for every row, typed and bounded."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, field_validator, model_validator

from runner.engine_config import Strict


class SamplingSpec(Strict):
    """vLLM's SamplingParams for every row. Bounds are vLLM's own; `extra_args` passes any other
    SamplingParams field verbatim (checked against vLLM when the engine starts)."""

    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, ge=1)
    seed: Optional[int] = 0
    retry_max_tokens: Optional[int] = Field(
        default=None, ge=1, description="retry once, with this budget, outputs cut off or failing the schema"
    )
    retry_repetition_penalty: Optional[float] = Field(default=None, gt=0, description=(
        "retry once, with this repetition penalty, outputs cut off or failing the schema (a loop)"))
    top_k: Optional[int] = Field(default=None, ge=-1, description="-1 or 0: all tokens")
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(default=None, gt=0, description="1: none; above 1 discourages repeats")
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    min_tokens: Optional[int] = Field(default=None, ge=0)
    stop: list[str] = Field(default=[], description="strings that end an output (they cut the JSON too)")
    n: int = Field(default=1, description="outputs per row: one extraction is stored per row")
    extra_args: dict[str, Any] = Field(default={}, description="other vllm.SamplingParams fields, verbatim")

    @field_validator("extra_args")
    @classmethod
    def _not_ours(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(v) & (set(cls.model_fields) | _SET_BY_RUNNER))
        if taken:
            where = "set by the runner" if taken[0] in _SET_BY_RUNNER else f"use sampling.{taken[0]}"
            raise ValueError(f"{taken[0]}: {where}, not in extra_args")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # vLLM takes one string as well as a list

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("an empty string would stop every output at once (vLLM refuses it)")
        return v

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("one extraction is stored per row, so n must be 1")
        return v

    @model_validator(mode="after")
    def _min_within_max(self) -> "SamplingSpec":
        """vLLM refuses min_tokens over max_tokens when the engine starts: said by validate instead
        (a retry's budget is at least max_tokens: runner/outputs.py)."""
        if self.min_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) is more than max_tokens ({self.max_tokens})")
        return self

    def vllm_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments beyond temperature, top_p, max_tokens and seed."""
        named = {k: getattr(self, k) for k in _OPTIONAL_SAMPLING if getattr(self, k) not in (None, [])}
        return named | self.extra_args

    def fingerprint_dump(self) -> dict:
        """The settings that make outputs; the optional ones only when set (older results keep
        their fingerprint)."""
        dump = self.model_dump(mode="json", exclude={"n", "extra_args", "retry_repetition_penalty", *_OPTIONAL_SAMPLING})
        retry = {"retry_repetition_penalty": self.retry_repetition_penalty} if self.retry_repetition_penalty else {}
        return dump | retry | self.vllm_kwargs()


_SET_BY_RUNNER = {"structured_outputs", "guided_decoding", "output_kind", "detokenize", "logprobs"}
_OPTIONAL_SAMPLING = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens",
                      "stop")
