"""Which files a job's input path names, and the format each is read as: a file, a folder (below
it, names that begin with `_` or `.` left out, linked folders followed, each file once) or a glob.
"""
from __future__ import annotations

import fnmatch
import glob
import os
from pathlib import Path
from typing import Iterator, Optional

from runner.errors import InputError


# File name endings of each input format; input.format names one, else the ending decides.
EXTENSIONS = {"parquet": (".parquet", ".pq"), "jsonl": (".jsonl", ".ndjson", ".json"), "csv": (".csv",),
              "openai-batch": (".jsonl",)}
# Text formats compressed as a whole file (docs.jsonl.gz): pyarrow reads these codecs by the ending.
COMPRESSED = (".gz", ".bz2")
_COMPRESSIBLE = ("jsonl", "csv", "openai-batch")


def _endings(fmt: str) -> tuple[str, ...]:
    """The name endings of one format, with its compressed forms."""
    plain = EXTENSIONS[fmt]
    return plain + tuple(e + c for e in plain for c in COMPRESSED) if fmt in _COMPRESSIBLE else plain


def _accepted_endings(declared: Optional[str]) -> tuple[str, ...]:
    """The name endings an input path reads: input.format's, or every known format's."""
    return _endings(declared) if declared else tuple(e for fmt in EXTENSIONS for e in _endings(fmt))


def file_format(file: str, declared: Optional[str]) -> str:
    """The format a file is read as: input.format, else its name's ending (docs.csv.gz is CSV)."""
    if declared:
        return declared
    for fmt in EXTENSIONS:
        if file.lower().endswith(_endings(fmt)):
            return fmt
    raise InputError(f"{file}: cannot tell the input format from the name; set input.format "
                     f"({', '.join(EXTENSIONS)})")


def input_files(path: str, declared: Optional[str] = None) -> list[str]:
    """The files a job's input path names: a file, a folder (its files of the format, or of any
    known format), or a glob. Below a folder or a glob's fixed part, names that begin with `_` or
    `.` are left out, as pyarrow, Spark and Hive leave them (_SUCCESS, _temporary/, .part-0.crc),
    unless the glob names such a part itself (data/_2024_*.parquet); linked folders are followed,
    each file read once."""
    endings = _accepted_endings(declared)
    if _is_glob(path):
        literal = _existing_folder(path)  # `[x]` in the job's own folder is not a pattern...
        files = _globbed(path, literal)
        if not files and any(ch in os.path.basename(literal) for ch in "*?["):
            # ...unless nothing matches below it as written and its own last name reads as a
            # pattern: `data/[ab]/*.parquet` beside an empty folder `[ab]` (the folders above stay
            # as written: `team [x]/data/` empty is not `team x/data/`)
            files = _globbed(path, os.path.dirname(literal))
    elif os.path.isdir(path):
        files = _unlinked_first(sorted(f for f in _walk(path) if os.path.basename(f).lower().endswith(endings)))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise InputError(f"{path}: input file not found")
    if not files:
        raise InputError(f"{path}: no input files match (Parquet, JSON Lines, CSV: {', '.join(sorted(set(endings)))}; "
                         "names that begin with _ or . are left out unless the pattern names them)")
    return files


def _is_glob(path: str) -> bool:
    """Whether the input path is read as a glob: it has a wildcard, and no file or folder has its
    name as written (a file named lit[1].jsonl is that file)."""
    return any(ch in path for ch in "*?[") and not os.path.exists(path)


def partition_root(path: str) -> Optional[str]:
    """The folder below which `key=value` folder names are hive partitions: the input folder, or a
    glob's fixed part (its leading folder as input_files reads it); None for a file named outright."""
    if _is_glob(path):
        return max(_fixed_part(path), _existing_folder(path), key=len)
    return path if os.path.isdir(path) else None


def would_read(target: str, path: str, declared: Optional[str] = None) -> bool:
    """Whether a file at `target` (absolute, links resolved) would be among the files the input path
    names, were it there: one of its format's endings in a folder the input folder's walk reads
    (linked folders too) under a name that is not hidden, or matched by the glob as input_files
    matches it (its existing leading folder taken as written), whatever its ending: a glob reads
    every file it names (`data/*` would then fail on a report.html)."""
    if _is_glob(path):
        literal = _existing_folder(path)
        return _glob_names(target, path, literal) or (
            any(ch in os.path.basename(literal) for ch in "*?[") and _glob_names(target, path, os.path.dirname(literal)))
    if not os.path.basename(target).lower().endswith(_accepted_endings(declared)):
        return False
    if os.path.isdir(path):
        parent, made = os.path.dirname(target), [os.path.basename(target)]
        while parent != os.path.dirname(parent) and not os.path.isdir(parent):  # folders the write would make
            made.append(os.path.basename(parent))
            parent = os.path.dirname(parent)
        parent = os.path.realpath(parent)
        return not any(_hidden(p) for p in made) and any(os.path.realpath(top) == parent for top, _ in _folders(path))
    return os.path.realpath(path) == target  # the input file itself, there now or not


def _glob_names(target: str, path: str, literal: str) -> bool:
    """Whether _globbed(path, literal) would name `target`: by its path below the glob's folder, or
    by a name through a linked folder the glob goes through (`data/*/x.parquet` with data/ext ->
    /mnt/ext reads /mnt/ext/x.parquet; data/current -> _staging/v2 is read as current/...)."""
    root = max(_fixed_part(path), literal, key=len)
    named = {part[0] for part in Path(os.path.relpath(path, root)).parts if part.startswith(("_", "."))}
    base = os.path.realpath(literal) if literal else os.sep
    relative = os.path.relpath(target, base)
    pattern = os.path.relpath(path, literal) if literal else path.lstrip(os.sep)
    if (not relative.startswith(os.pardir) and _parts_match(Path(pattern).parts, Path(relative).parts)
            and not _hidden(os.path.relpath(target, os.path.realpath(root)), named)):
        return True
    below = Path(os.path.relpath(path, root)).parts  # the pattern below root, as root's names match it
    if below[-1] != "**" and not fnmatch.fnmatchcase(os.path.basename(target), below[-1]):
        return False  # not a name the glob reads: no folder to look for (a walk of the whole tree)
    for name, real in _linked_folders(root, named, None if "**" in below else len(below) - 1):
        rest = os.path.relpath(target, real)
        if not rest.startswith(os.pardir) and rest != os.curdir:
            through = os.path.normpath(os.path.join(name, rest))
            if _parts_match(below, Path(through).parts) and not _hidden(through, named):
                return True
    return False


def _linked_folders(root: str, named: set[str], depth: Optional[int]) -> Iterator[tuple[str, str]]:
    """(name below root, real path) of each link below root that a glob would go through as a
    folder: to a folder, or dangling (a write that makes its target makes it one). depth: the most
    parts such a name may have (None: any, `**`); hidden names are not gone into. A folder is not
    gone into again below itself (a link back up); reached by two names, it is gone into by each,
    as glob reads it by each."""
    stack = [("", root, frozenset())] if os.path.isdir(root) and depth != 0 else []  # 0: no folder named
    while stack:
        name, folder, above = stack.pop()
        real = os.path.realpath(folder)
        if real in above:
            continue
        try:
            entries = list(os.scandir(folder))
        except OSError:  # unreadable: glob reads nothing there either
            continue
        for entry in entries:
            inner = os.path.join(name, entry.name)
            if _hidden(entry.name, named):
                continue
            try:
                is_dir = entry.is_dir()  # through links: a loop of links, or no permission, raises
            except OSError:
                is_dir = False
            if entry.is_symlink():
                real_target = os.path.realpath(entry.path)
                if is_dir or not os.path.lexists(real_target):
                    yield inner, real_target
            if is_dir and (depth is None or len(Path(inner).parts) < depth):
                stack.append((inner, entry.path, above | {real}))


def _parts_match(pattern: tuple, parts: tuple) -> bool:
    """glob's rule, part by part: `**` stands for any number of folders, other parts as fnmatch."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_parts_match(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _parts_match(pattern[1:], parts[1:])


def _globbed(path: str, literal: str) -> list[str]:
    """The files a glob names, its leading part `literal` taken as written."""
    root = max(_fixed_part(path), literal, key=len)
    named = {part[0] for part in Path(os.path.relpath(path, root)).parts if part.startswith(("_", "."))}
    pattern = os.path.join(glob.escape(literal), os.path.relpath(path, literal)) if literal else path
    return _unlinked_first(sorted(f for f in glob.glob(pattern, recursive=True)
                                  if os.path.isfile(f) and not _hidden(os.path.relpath(f, root), named)))


def _hidden(relative: str, named: set[str] = frozenset()) -> bool:
    """A path below the input's folder with a part that begins with `_` or `.` (but not with one the
    pattern's own parts begin with: `named`)."""
    return any(part[0] in "_." and part[0] not in named and part not in (".", "..") for part in Path(relative).parts)


def _existing_folder(pattern: str) -> str:
    """The longest leading part of the pattern that is a folder as written ("" if none)."""
    parts = Path(pattern).parts
    for i in range(len(parts) - 1, 0, -1):
        if os.path.isdir(os.path.join(*parts[:i])):
            return os.path.join(*parts[:i])
    return ""


def _fixed_part(pattern: str) -> str:
    """The folder a glob's pattern starts from: its parts before the first with a wildcard."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if any(ch in part for ch in "*?[")), len(parts))
    return str(Path(*parts[:fixed])) if fixed else "."


def _once(files: list[str]) -> list[str]:
    """Each file once, by its first name: `**` through a link back up names the same files again, as
    does a link to a file (latest.parquet -> part-7.parquet) beside it."""
    seen: set[str] = set()
    return [f for f in files if not (os.path.realpath(f) in seen or seen.add(os.path.realpath(f)))]


def _unlinked_first(files: list[str]) -> list[str]:
    """Each file once: a link to a file the walk reads under its own name too (latest.parquet ->
    year=2024/part-7.parquet) is left to that name, which holds the hive partition; else by its first name."""
    plain = {os.path.realpath(f) for f in files if not os.path.islink(f)}
    return _once([f for f in files if not os.path.islink(f) or os.path.realpath(f) not in plain])


def _walk(folder: str) -> Iterator[str]:
    """The files below folder, through links to folders outside it, without hidden names (_hidden).
    A link to a folder inside it is left to the folder's own path (a hive partition's key=value
    is in that path, not the link's); each real folder is read once."""
    for top, names in _folders(folder):
        for name in names:
            f = os.path.join(top, name)
            if not _hidden(name) and os.path.isfile(f):
                yield f


def _folders(folder: str) -> Iterator[tuple[str, list[str]]]:
    """(folder, its names) of each folder _walk reads: folder itself, and below it, through links."""
    root = os.path.realpath(folder)
    seen = set()
    for top, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not _hidden(d) and not _link_inside(os.path.join(top, d), root))
        yield top, names


def _link_inside(path: str, root: str) -> bool:
    """A link to a folder within root (or root itself) that the walk reaches by its own path (not
    below a hidden name: `current -> _staging/v2` is read through the link)."""
    if not os.path.islink(path):
        return False
    target = os.path.realpath(path)
    return target == root or target.startswith(root + os.sep) and not _hidden(os.path.relpath(target, root))
