"""The job's output schema file: valid JSON, a valid JSON Schema, and no reference outside the
file (the runner never opens a socket because of a schema)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runner.errors import SpecError
from runner.fast_schema import is_number


def load_schema(path: Path, where: str) -> dict[str, Any]:
    """Load a JSON Schema file and check that it is a valid schema."""
    try:
        return _load_schema(path, where)
    except RecursionError:  # the JSON decoder, jsonschema and the checks below all recurse
        raise SpecError(f"{path}: nested too deeply to be checked (or to be a grammar vLLM compiles)") from None


def _load_schema(path: Path, where: str) -> dict[str, Any]:
    import jsonschema

    try:
        # a BOM (Windows editors) is no JSON error; NaN is not JSON, and of a key given twice json
        # would keep the last without a word
        schema = json.loads(path.read_text(encoding="utf-8-sig"), parse_constant=_not_json, object_pairs_hook=_once)
    except FileNotFoundError:
        raise SpecError(f"{where}: output_schema: file not found: {path}") from None
    except (OSError, ValueError) as exc:  # ValueError: json's, a decoding error, the two hooks'
        raise SpecError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise SpecError(f"{path}: a JSON Schema must be an object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        loc = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise SpecError(f"{path}: not a valid JSON Schema at {loc}: {exc.message}") from None
    remote = next(remote_refs(schema), None)
    if remote is not None:
        where, ref = remote
        raise SpecError(f"{path}: {where}: $ref {ref!r} points outside the file; the runner never fetches "
                        f"schemas (it runs without a network): copy it under $defs and use \"#/$defs/NAME\"")
    dangling = next(dangling_refs(schema), None)
    if dangling is not None:
        where, ref = dangling
        raise SpecError(f"{path}: {where}: $ref {ref!r} points to nothing in the file (vLLM would refuse every "
                        f"row's grammar)")
    from runner.schema_loops import looping_refs  # it reads pointers with this module's helpers

    looping = next(looping_refs(schema), None)
    if looping is not None:
        where, ref = looping
        raise SpecError(f"{path}: {where}: $ref {ref!r} leads back to itself without going into the value "
                        f"(through references, anchors, allOf, anyOf, oneOf, not, if/then/else, dependentSchemas): "
                        f"checking a value there would recurse without end")
    impossible = next(unsatisfiable(schema), None)
    if impossible is not None:
        where, why = impossible
        raise SpecError(f"{path}: {where}: {why}: no value fits it, so every row would fail")
    return schema


# each pair of bounds, and the types it holds for: a value of another type escapes it
_BOUNDS = (("minimum", "maximum", {"integer", "number"}), ("minLength", "maxLength", {"string"}),
           ("minItems", "maxItems", {"array"}), ("minProperties", "maxProperties", {"object"}))


def unsatisfiable(schema: Any, where: str = "#"):
    """(location, why) of the plain contradictions a schema can hold where every value meets them
    (see _schemas): an empty enum, a lower bound over its upper one, a required property that
    additionalProperties: false forbids."""
    for at, node in _schemas(schema, where):
        if node.get("enum") == []:
            yield at, "enum is empty"
        types = _types(node)
        for lo, hi, kinds in _BOUNDS:
            a, b = node.get(lo), node.get(hi)
            if is_number(a) and is_number(b) and a > b and types and types <= kinds:
                yield at, f"{lo} {a} is over {hi} {b}"
        props = node.get("properties")
        if (node.get("additionalProperties") is False and isinstance(props, dict) and "patternProperties" not in node
                and types == {"object"} and isinstance(node.get("required"), list)):
            for name in node["required"]:
                if isinstance(name, str) and name not in props:
                    yield at, f"requires {name!r}, which additionalProperties: false forbids (not in properties)"


def _types(node: dict) -> set:
    """The types a schema allows by its `type` (empty: any)."""
    kind = node.get("type")
    return {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _schemas(node: Any, where: str):
    """(location, subschema) of the schema and of the schemas every value must fit inside it: the
    required properties', allOf's, and the items of an array that must have some. (An optional
    property, or a branch of anyOf, may be impossible on purpose: another way fits.)"""
    if not isinstance(node, dict):
        return
    yield where, node
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in node.get("required") if isinstance(node.get("required"), list) else []:
        if isinstance(name, str) and name in props:
            yield from _schemas(props[name], f"{where}/properties/{name}")
    for i, sub in enumerate(node.get("allOf") or []):
        yield from _schemas(sub, f"{where}/allOf/{i}")
    if is_number(node.get("minItems")) and node["minItems"] >= 1:
        yield from _schemas(node.get("items"), f"{where}/items")


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _once(pairs: list) -> dict:
    """An object whose keys are each given once: of a key given twice, json keeps the last silently."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice in one object")
        out[key] = value
    return out


def check_examples(examples: list, schema: dict[str, Any], where: str) -> None:
    """Each few-shot assistant turn must be an extraction that fits the schema: one that does not
    teaches the model answers the grammar then forbids (the rows it shapes fail or get cut)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    for i, turn in enumerate(examples):
        if turn.role != "assistant":
            continue
        field = f"{where}: prompts.examples[{i}].content"
        try:
            value = json.loads(turn.content)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{field}: not JSON ({exc.msg}): an assistant turn is an extraction "
                            "the output schema allows") from None
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            loc = "/".join(str(p) for p in error.absolute_path)
            raise SpecError(f"{field}: does not fit the output schema{f' at {loc}' if loc else ''}: {error.message}")


_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")


def remote_refs(schema: Any, where: str = "#"):
    """(location, reference) of every reference that is not inside the document itself: local ones
    start with `#` or name an `$id` the document defines."""
    from urllib.parse import urljoin

    root = schema.get("$id", "").split("#", 1)[0] if isinstance(schema, dict) else ""
    ids = {urljoin(root, i) for i in _ids(schema)} | {root}
    for loc, ref in _refs(schema, where):
        base = ref.split("#", 1)[0]
        if base and urljoin(root, base) not in ids:
            yield loc, ref


def dangling_refs(schema: Any):
    """(location, reference) of every reference within the document (`#/...` pointers, `#name`
    anchors) that finds nothing in it. Only where the document names no nested `$id` (references
    are then all from its root)."""
    if isinstance(schema, dict) and any(True for _ in _ids({k: v for k, v in schema.items() if k != "$id"})):
        return
    anchors = set(_anchors(schema))
    for loc, ref in _refs(schema, "#"):
        if ref.startswith("#") and not ref.startswith("#/") and ref != "#":
            if ref[1:] not in anchors:
                yield loc, ref
            continue
        if not (ref == "#" or ref.startswith("#/")):
            continue
        if pointed(schema, ref) is NOTHING:
            yield loc, ref


NOTHING = object()


def pointed(schema: Any, ref: str) -> Any:
    """What a `#/...` pointer finds in the document, or NOTHING (as jsonschema resolves it; the
    export follows a field's `$ref` the same way)."""
    return at(schema, pointer_parts(ref))


def pointer_parts(ref: str) -> tuple[str, ...]:
    """A `#/...` pointer's parts as jsonschema reads them: the fragment percent-decoded whole, then
    split, then ~1 and ~0."""
    from urllib.parse import unquote

    return tuple(p.replace("~1", "/").replace("~0", "~") for p in unquote(ref[1:]).split("/")[1:])


def at(schema: Any, parts: tuple[str, ...]) -> Any:
    """The node at these pointer parts, or NOTHING."""
    node = schema
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return NOTHING
    return node


_DATA_KEYS = ("examples", "default", "const", "enum")  # their values are instances, not schemas
_NAME_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def _refs(node: Any, where: str, names: bool = False):
    """(location, reference) of every reference in the schema (not in its instance data: a property
    called `default` is a schema, an object under `default` is data)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _REF_KEYS and isinstance(value, str) and not names:
                yield f"{where}/{key}", value
            elif names or key not in _DATA_KEYS:
                yield from _refs(value, f"{where}/{key}", names=not names and key in _NAME_MAPS)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _refs(value, f"{where}/{i}")


def _ids(node: Any):
    """The base URIs `$id` names anywhere in the document."""
    return (i.split("#", 1)[0] for i in _keyword_texts(node, ("$id",), data=True))


def _anchors(node: Any):
    """The names `$anchor` and `$dynamicAnchor` give in the document (data values left out)."""
    return _keyword_texts(node, ("$anchor", "$dynamicAnchor"), data=False)


def _keyword_texts(node: Any, keys: tuple[str, ...], data: bool):
    """The text values of these keywords, a node's own before those below it; `data`: also under
    the keywords whose values are instances (_DATA_KEYS)."""
    if isinstance(node, dict):
        for key in keys:
            if isinstance(node.get(key), str):
                yield node[key]
        for key, value in node.items():
            if data or key not in _DATA_KEYS:
                yield from _keyword_texts(value, keys, data)
    elif isinstance(node, list):
        for value in node:
            yield from _keyword_texts(value, keys, data)
