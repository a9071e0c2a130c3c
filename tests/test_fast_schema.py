"""The fast schema check against jsonschema itself, on generated instances: they must agree."""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import jsonschema
import pytest

from bench.workload import INCIDENT_SCHEMA, SCHEMA as INVOICE_SCHEMA
from runner.fast_schema import compile_schema
from tests.conftest import SCHEMA

ROOT = Path(__file__).resolve().parent.parent
EXTRA = {
    "type": "object",
    "$defs": {"tag": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2}},
    "properties": {
        "n": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10},
        "x": {"type": ["number", "null"], "maximum": 2.5},
        "flag": {"const": True},
        "kind": {"enum": [1, "one", None, [1, 2]]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
        "nested": {"type": "object", "additionalProperties": {"type": "boolean"}},
    },
    "required": ["n", "tags"],
    "additionalProperties": False,
}
SCHEMAS = {"test": SCHEMA, "invoice": INVOICE_SCHEMA, "incident": INCIDENT_SCHEMA, "extra": EXTRA,
           "sample": json.loads((ROOT / "schemas" / "summarize.schema.json").read_text())}
VALUES = [None, True, False, 0, 1, -1, 1.0, 1.5, 2.5, 9.999, 10, 11, "", "a", "ab", "é" * 3, "x" * 300, "AB", [],
          [1, 2], ["ab", "cd"], ["ab"] * 4, {}, {"a": True}, {"a": 1}, "EUR", "sev1", "positive", "neutral"]


def mutations(value, rng, depth=0):
    """Random edits of a value: replace, drop or add keys, change list items."""
    yield value
    for _ in range(60):
        v = copy.deepcopy(value)
        if isinstance(v, dict) and v and rng.random() < 0.8:
            k = rng.choice(list(v))
            action = rng.random()
            if action < 0.5:
                v[k] = rng.choice(VALUES)
            elif action < 0.7:
                del v[k]
            elif action < 0.85:
                v[rng.choice(["extra", "zz", k + "_"])] = rng.choice(VALUES)
            elif depth < 2:
                v[k] = next(iter(list(mutations(v[k], rng, depth + 1))[1:2]), v[k])
        else:
            v = rng.choice(VALUES)
        yield v


def example(schema):
    from runner.engines.fake import example_for_schema

    return example_for_schema(schema, "seed")


@pytest.mark.parametrize("name", SCHEMAS)
def test_the_fast_check_agrees_with_jsonschema(name):
    schema = SCHEMAS[name]
    fast = compile_schema(schema)
    assert fast is not None, f"{name} should compile"
    validator = jsonschema.validators.validator_for(schema)(schema)
    rng = random.Random(name)
    base = example(schema) if name != "extra" else {"n": 3, "tags": ["ab"], "x": 1.5, "flag": True, "kind": "one"}
    seen = {True: 0, False: 0}
    for value in mutations(base, rng):
        expected = validator.is_valid(value)
        assert fast(value) == expected, (name, value)
        seen[expected] += 1
    assert seen[True] and seen[False]  # both answers were exercised


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}},
    {"type": "object", "patternProperties": {"^x": {"type": "string"}}},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
    {"type": "array", "items": [{"type": "string"}]},
    {"$ref": "other.json"},
    {"properties": {"a": {"$ref": "#/$defs/x", "maxLength": 3}}, "$defs": {"x": {"type": "string"}}},
])
def test_schemas_beyond_the_subset_get_no_fast_check(schema):
    assert compile_schema(schema) is None
