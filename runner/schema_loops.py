"""References in the output schema that lead back to where they were reached from without going
into the value: through `$ref` (or an `$anchor`) and the keywords that apply a subschema to the
same value (allOf, anyOf, oneOf, not, if/then/else, dependentSchemas, dependencies). Checking a
value that reaches such a loop recurses until Python's stack runs out. A reference reached through
properties or items is fine (a tree's node refers to itself for its children)."""
from __future__ import annotations

from typing import Any, Iterator, Optional

from runner.schema_file import _DATA_KEYS, _NAME_MAPS, _REF_KEYS, NOTHING, at, pointer_parts

_LISTS = ("allOf", "anyOf", "oneOf")  # each subschema applies to the same value
_ONE = ("not", "if", "then", "else")
_MAPS = _NAME_MAPS + ("dependencies",)  # a name's schema before 2019-09 (or a list of names)
Path = tuple[str, ...]
Edge = tuple[Path, Optional[tuple[str, str]]]  # (where it goes, (the reference's location, the reference) or None)


def looping_refs(schema: Any) -> Iterator[tuple[str, str]]:
    """(location, reference) of a reference that closes such a loop: the first found, then stops.
    References below a nested `$id` (relative to it) are left to the validator."""
    if not isinstance(schema, dict):
        return
    anchors: dict[str, Path] = {}
    for name, where in _anchor_paths(schema):
        anchors.setdefault(name, where)  # as jsonschema: the first of a name
    walk = _Walk(schema, anchors)
    for start in walk.ref_targets(schema, ()):
        found = walk.from_start(start)
        if found is not None:
            yield found
            return


class _Walk:
    def __init__(self, schema: dict, anchors: dict[str, Path]):
        self.schema, self.anchors = schema, anchors
        self.state: dict[Path, bool] = {}  # True: on the current path; False: done, no loop below
        self.id_roots = {where for node, where in _schemas(schema, ()) if where and isinstance(node.get("$id"), str)}
        # before draft 2019-09 a $ref's siblings are ignored: only the reference applies
        self.ref_alone = any(f"draft-0{n}" in str(schema.get("$schema", "")) for n in range(3, 8))

    def from_start(self, start: Path) -> Optional[tuple[str, str]]:
        if start in self.state:
            return None
        frames = [(start, iter(self.edges(start)), None)]
        self.state[start] = True
        while frames:
            path, edges, _ = frames[-1]
            nxt = next(edges, None)
            if nxt is None:
                self.state[path] = False
                frames.pop()
                continue
            child, via = nxt
            if self.state.get(child) is True:  # back on the path: the last reference in the loop closes it
                at = next(i for i, f in enumerate(frames) if f[0] == child)
                return via or next(f[2] for f in reversed(frames[at + 1:]) if f[2] is not None)
            if child not in self.state:
                self.state[child] = True
                frames.append((child, iter(self.edges(child)), via))
        return None

    def edges(self, path: Path) -> Iterator[Edge]:
        node = at(self.schema, path)
        if not isinstance(node, dict):
            return
        relative = any(path[:i] in self.id_roots for i in range(1, len(path) + 1))  # to a nested $id
        for key in _REF_KEYS:
            target = None if relative else self.target(node.get(key))
            if target is not None:
                yield target, (_location(path + (key,)), node[key])
        if self.ref_alone and isinstance(node.get("$ref"), str):
            return
        for key in _LISTS:
            if isinstance(node.get(key), list):
                yield from ((path + (key, str(i)), None) for i in range(len(node[key])))
        for key in _ONE:  # then and else apply only beside an if
            if isinstance(node.get(key), dict) and (key in ("not", "if") or "if" in node):
                yield path + (key,), None
        for key in ("dependentSchemas", "dependencies"):  # dependencies: a name's schema (before 2019-09)
            if isinstance(node.get(key), dict):
                yield from ((path + (key, name), None) for name, sub in node[key].items() if isinstance(sub, dict))

    def target(self, ref: Any) -> Optional[Path]:
        """Where a local reference points (None: not local, or nothing there)."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        if ref == "#" or ref.startswith("#/"):
            path = pointer_parts(ref)
            return path if at(self.schema, path) is not NOTHING else None
        return self.anchors.get(ref[1:])

    def ref_targets(self, node: Any, path: Path) -> Iterator[Path]:
        """Where every local reference in the document points, in document order."""
        for sub, sub_path in _schemas(node, path):
            for key in _REF_KEYS:
                target = self.target(sub.get(key))
                if target is not None:
                    yield target


def _schemas(node: Any, path: Path, names: bool = False) -> Iterator[tuple[dict, Path]]:
    """Every object in the document that is a schema (instance data left out), with its path."""
    if isinstance(node, dict):
        if not names:
            yield node, path
        for key, value in node.items():
            if names or key not in _DATA_KEYS:
                yield from _schemas(value, path + (key,), names=not names and key in _MAPS)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _schemas(value, path + (str(i),))


def _anchor_paths(schema: Any) -> Iterator[tuple[str, Path]]:
    for node, where in _schemas(schema, ()):
        for key in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(key), str):
                yield node[key], where


def _location(path: Path) -> str:
    return "#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in path)
