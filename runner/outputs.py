"""Checking each generated output against the job's JSON Schema.

A bad output is a value (a status and an error), never an exception: every row is stored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from runner.engines.base import Completion
from runner.fast_schema import compile_schema
from runner.rows import Status


@dataclass
class Checked:
    status: Status
    extraction_json: Optional[str]
    error: Optional[str]


class OutputChecker:
    """Parses outputs and validates them against one schema (the validator is built once)."""

    def __init__(self, schema: dict):
        import jsonschema
        from referencing import Registry
        from referencing.exceptions import NoSuchResource

        def offline(uri: str):  # jsonschema would fetch unknown references over the network
            raise NoSuchResource(ref=uri)

        cls = jsonschema.validators.validator_for(schema)
        self._validator = cls(schema, format_checker=cls.FORMAT_CHECKER, registry=Registry(retrieve=offline))
        self._fast = compile_schema(schema)  # None: jsonschema checks every row

    def check(self, c: Completion, max_tokens: int) -> Checked:
        if c.error is not None:
            return Checked(Status.FAILED, None, c.error)
        try:
            value = json.loads(c.text)
        except json.JSONDecodeError as exc:
            if c.finish_reason == "length":
                return Checked(Status.TRUNCATED, None, f"output cut off at max_tokens={max_tokens} ({c.completion_tokens} tokens)")
            return Checked(Status.INVALID_JSON, None, f"not valid JSON: {exc.msg} at char {exc.pos}")
        if self._fast is not None and self._fast(value):
            return Checked(Status.OK, json.dumps(value, ensure_ascii=False), None)
        problem = next(iter(sorted(self._validator.iter_errors(value), key=lambda e: list(e.absolute_path))), None)
        if problem is not None:
            where = "/".join(str(p) for p in problem.absolute_path) or "(root)"
            return Checked(Status.SCHEMA_MISMATCH, json.dumps(value, ensure_ascii=False), f"schema: at {where}: {problem.message}")
        return Checked(Status.OK, json.dumps(value, ensure_ascii=False), None)


def retry_tokens(checked: Checked, attempt: int, max_tokens: int, sampling, room: Optional[int] = None) -> Optional[int]:
    """The retry policy: an output cut off or failing the schema gets one more attempt when
    sampling.retry_max_tokens (a budget, at least the first one) or sampling.retry_repetition_penalty
    (a penalty for outputs that loop, on the retry only) is set; None: store it as it is. `room`:
    the tokens max_model_len leaves after the prompt, where vLLM would stop the retry short of its
    budget (a long prompt, or a document cut to fit); a retry that could not write more, and has no
    penalty to change its output, is not made."""
    retry_max, penalty = sampling.retry_max_tokens, sampling.retry_repetition_penalty
    if attempt > 1 or not (retry_max or penalty) or checked.status in (Status.OK, Status.FAILED):
        return None
    budget = max(retry_max or max_tokens, max_tokens)
    if room is not None and budget > room:
        budget = max(room, max_tokens)
        if budget == max_tokens and not penalty:
            return None
    return budget
