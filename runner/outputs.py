"""Checking each generated output against the job's JSON Schema.

A bad output is a value (a status and an error), never an exception: every row is stored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from runner.engines.base import Completion
from runner.fast_schema import compile_schema

# Final statuses; every one of them counts as done for resume.
OK = "ok"
TRUNCATED = "truncated"  # cut off at max_tokens
INVALID_JSON = "invalid_json"
SCHEMA_MISMATCH = "schema_mismatch"
FAILED = "failed"  # never generated: too long for the model, or rejected by the engine
STATUSES = (OK, TRUNCATED, INVALID_JSON, SCHEMA_MISMATCH, FAILED)


@dataclass
class Checked:
    status: str
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
            return Checked(FAILED, None, c.error)
        try:
            value = json.loads(c.text)
        except json.JSONDecodeError as exc:
            if c.finish_reason == "length":
                return Checked(TRUNCATED, None, f"output cut off at max_tokens={max_tokens} ({c.completion_tokens} tokens)")
            return Checked(INVALID_JSON, None, f"not valid JSON: {exc.msg} at char {exc.pos}")
        if self._fast is not None and self._fast(value):
            return Checked(OK, json.dumps(value, ensure_ascii=False), None)
        problem = next(iter(sorted(self._validator.iter_errors(value), key=lambda e: list(e.absolute_path))), None)
        if problem is not None:
            where = "/".join(str(p) for p in problem.absolute_path) or "(root)"
            return Checked(SCHEMA_MISMATCH, json.dumps(value, ensure_ascii=False), f"schema: at {where}: {problem.message}")
        return Checked(OK, json.dumps(value, ensure_ascii=False), None)
