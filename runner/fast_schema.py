"""A fast yes/no check for the JSON Schemas extraction jobs use, with jsonschema as the reference.

jsonschema's generic machinery costs ~17 µs per small object, a large part of the runner's own
work per row. Schemas built only from the keywords below compile to plain Python closures; any
other keyword (anywhere in the schema) means no fast check, and jsonschema does everything. The
fast check only says valid or not: the message for an invalid output still comes from jsonschema.
tests/test_fast_schema.py compares the two on generated instances.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

Check = Callable[[Any], bool]

_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id", "$defs",
                "definitions", "deprecated", "readOnly", "writeOnly"}
_SUPPORTED = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "enum", "const", "minLength",
                             "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                             "items", "minItems", "maxItems", "$ref"}


class _Unsupported(Exception):
    pass


def compile_schema(schema: Any) -> Optional[Check]:
    """A function value -> valid, or None when the schema uses a keyword this module does not know."""
    try:
        return _Compiler(schema).compile(schema)
    except (_Unsupported, KeyError, TypeError, re.error):
        return None


def is_number(v: Any) -> bool:
    """A JSON number: an int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_TYPES: dict[str, Check] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "number": is_number,
    "integer": lambda v: is_number(v) and (isinstance(v, int) or v.is_integer()),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema means it: 1 equals 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if is_number(a) and is_number(b):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


class _Compiler:
    def __init__(self, root: Any):
        self.root = root
        self.refs: dict[str, Check] = {}

    def compile(self, schema: Any) -> Check:
        if schema is True or schema == {}:
            return lambda v: True
        if schema is False:
            return lambda v: False
        if not isinstance(schema, dict) or set(schema) - _SUPPORTED:
            raise _Unsupported(schema)
        checks = [c for c in (self._ref(schema), self._type(schema), self._enum(schema), self._string(schema),
                              self._number(schema), self._object(schema), self._array(schema)) if c is not None]
        if len(checks) == 1:
            return checks[0]
        return lambda v: all(c(v) for c in checks)

    def _ref(self, s: dict) -> Optional[Check]:
        ref = s.get("$ref")
        if ref is None:
            return None
        if not isinstance(ref, str) or not ref.startswith("#/") or set(s) - _ANNOTATIONS - {"$ref"}:
            raise _Unsupported(ref)  # beside $ref, other keywords apply in some drafts and not in others
        if ref not in self.refs:
            self.refs[ref] = lambda v: target(v)  # placeholder: recursive schemas refer to themselves
            node = self.root
            for part in ref[2:].split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
            target = self.compile(node)
            self.refs[ref] = target
        return self.refs[ref]

    def _type(self, s: dict) -> Optional[Check]:
        t = s.get("type")
        if t is None:
            return None
        kinds = [_TYPES[k] for k in ([t] if isinstance(t, str) else t)]
        return kinds[0] if len(kinds) == 1 else (lambda v: any(k(v) for k in kinds))

    def _enum(self, s: dict) -> Optional[Check]:
        allowed = list(s["enum"]) if "enum" in s else None
        if "const" in s:
            allowed = [s["const"]] if allowed is None else [a for a in allowed if _json_equal(a, s["const"])]
        if allowed is None:
            return None
        if all(isinstance(a, str) for a in allowed):
            strings = frozenset(allowed)
            return lambda v: isinstance(v, str) and v in strings
        return lambda v: any(_json_equal(v, a) for a in allowed)

    def _string(self, s: dict) -> Optional[Check]:
        lo, hi, pattern = s.get("minLength", 0), s.get("maxLength"), s.get("pattern")
        if not lo and hi is None and pattern is None:
            return None
        rx = re.compile(pattern) if pattern is not None else None
        return lambda v: not isinstance(v, str) or (lo <= len(v) and (hi is None or len(v) <= hi)
                                                   and (rx is None or rx.search(v) is not None))

    def _number(self, s: dict) -> Optional[Check]:
        bounds = [(s.get(k), op) for k, op in (("minimum", lambda v, b: v >= b), ("maximum", lambda v, b: v <= b),
                                                ("exclusiveMinimum", lambda v, b: v > b),
                                                ("exclusiveMaximum", lambda v, b: v < b))]
        bounds = [(b, op) for b, op in bounds if b is not None]
        if not bounds:
            return None
        if not all(is_number(b) for b, _ in bounds):
            raise _Unsupported(s)  # draft-4 boolean exclusive bounds
        return lambda v: not is_number(v) or all(op(v, b) for b, op in bounds)

    def _object(self, s: dict) -> Optional[Check]:
        props = {k: self.compile(v) for k, v in s.get("properties", {}).items()}
        required = list(s.get("required", []))
        extra = s.get("additionalProperties", True)
        extra_check = None if extra is True else self.compile(extra)
        if not props and not required and extra_check is None:
            return None

        def check(v: Any) -> bool:
            if not isinstance(v, dict):
                return True
            for k in required:
                if k not in v:
                    return False
            for k, item in v.items():
                c = props.get(k)
                if c is not None:
                    if not c(item):
                        return False
                elif extra_check is not None and not extra_check(item):
                    return False
            return True

        return check

    def _array(self, s: dict) -> Optional[Check]:
        items = s.get("items")
        if isinstance(items, list):
            raise _Unsupported(items)  # tuple validation differs between drafts
        item = self.compile(items) if items is not None else None
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if item is None and not lo and hi is None:
            return None
        return lambda v: not isinstance(v, list) or (lo <= len(v) and (hi is None or len(v) <= hi)
                                                    and (item is None or all(item(x) for x in v)))
