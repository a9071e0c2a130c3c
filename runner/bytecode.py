"""Bytecode of the engine's libraries under the runner's cache folder, where Python cannot keep it
beside them.

Python compiles a module from source unless it finds the module's bytecode: beside the source (in
`__pycache__`) or, once a bytecode prefix is set, under that folder only. Where torch and vLLM came
without bytecode and Python may not write it beside them (PYTHONDONTWRITEBYTECODE=1, which container
images often set, or a read-only site-packages), every process compiles them again: on the H200
machine `from vllm import LLM` took 20.5-26.9 s that way and 13.2-13.4 s reading bytecode from a
prefix (bench/bytecode.py). There the runner points Python's prefix at a folder of its cache and
lets it write: the first process compiles and writes (35.8 s there), later ones read. Where the
bytecode is beside the libraries, or Python can write it there, nothing changes: a prefix would
hide what is there.

The folder is the runner's own (created 0700, refused if another user owns it or others can write
it: Python runs what it finds there) and named by the interpreter and the libraries' versions, so
that an image with other files under the same paths does not read this one's bytecode. Every process
that sets it marks it used; folders of other versions that no process used for KEEP_DAYS are removed.
"""
from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path
from typing import Iterable, MutableMapping, Optional

PROBES = ("torch", "vllm")  # where the engine's import spends its time
SWITCH = "RUNNER_BYTECODE_CACHE"  # 0/off/false/no leaves Python's bytecode settings alone
KEEP_DAYS = 30  # a folder no run used for this long (an upgraded torch or vLLM) is removed
USED = ".last-used"  # touched by every process that sets its folder
INHERITED = "RUNNER_PYCACHE_PREFIX"  # beside PYTHONPYCACHEPREFIX: the prefix a runner process set

UNDECIDED = "not decided in this process"
_state: dict = {"prefix": None, "set_by_runner": False, "reason": UNDECIDED}


def bytecode_beside(name: str) -> tuple[Optional[str], bool]:
    """The package's `__init__` source (found without importing it; None: not installed, or not
    plain source files, a zip or an extension) and whether Python's bytecode of it is beside it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except Exception:  # a broken finder (an editable install's, say) is no reason to fail a run
        return None, False
    if spec is None or not spec.origin or not spec.origin.endswith(".py") or not os.path.isfile(spec.origin):
        return None, False
    return spec.origin, os.path.exists(importlib.util.cache_from_source(spec.origin))


def missing_bytecode(packages: Iterable[str] = PROBES) -> list[str]:
    """The packages, of those installed, whose `__init__` has no bytecode beside its source that
    Python would read and where Python may not write it."""
    missing = []
    for name in packages:
        origin, beside = bytecode_beside(name)
        if origin is None or beside:
            continue
        writable = not sys.dont_write_bytecode and os.access(os.path.dirname(origin), os.W_OK)
        if not writable:  # else Python writes it beside the source itself, once
            missing.append(name)
    return missing


def folder_name(packages: Iterable[str] = PROBES) -> str:
    """A name for this interpreter and these libraries' versions."""
    from importlib import metadata

    parts = [sys.version, os.path.realpath(sys.executable)]
    for name in packages:
        try:
            parts.append(f"{name}=={metadata.version(name)}")
        except Exception:
            parts.append(f"{name}==?")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def private_folder(folder: Path) -> Optional[str]:
    """Create `folder` (0700) and check that only this user can write it and its parent; None if
    fine, else why not."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for path in (folder, folder.parent):
            st = path.stat()
            if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return f"{path} is another user's or others can write it"
        probe = folder / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"{folder} cannot be written: {exc.strerror or exc}"
    return None


def use_cache(root: Path, environ: MutableMapping[str, str] = os.environ,
              packages: Iterable[str] = PROBES) -> Optional[str]:
    """Keep bytecode under a folder of `root` (for this process and the processes it starts) when
    the engine's libraries have none beside them and Python may not write it there. Returns the
    folder set, or None where nothing changed (the reason is in `state()`)."""
    packages = tuple(packages)
    if switched_off(environ):
        return _decided(None, f"{SWITCH}={environ[SWITCH]}")
    if sys.pycache_prefix is not None and environ.get(INHERITED) == sys.pycache_prefix:
        # a Ray actor or a spawned process of a runner that set it
        return _decided(sys.pycache_prefix, "set by the runner process that started this one")
    if sys.pycache_prefix is not None:
        return _decided(None, "a bytecode prefix was set before (PYTHONPYCACHEPREFIX or -X pycache_prefix)")
    missing = missing_bytecode(packages)
    if not missing:
        return _decided(None, "bytecode beside the libraries, or Python may write it there")
    folder = Path(os.path.abspath(root)) / folder_name(packages)
    refused = private_folder(folder)
    if refused:  # an unwritable prefix would hide every module's bytecode: slower than none
        return _decided(None, f"no bytecode beside {', '.join(missing)}, but {refused}")
    pruned = prune_unused(folder)
    prefix = str(folder)
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    # Processes the runner starts read it (a forked engine core inherits the settings above). A
    # spawned one writes nothing if the runner was started with PYTHONDONTWRITEBYTECODE=1: Python
    # hands such children -B.
    environ["PYTHONPYCACHEPREFIX"] = environ[INHERITED] = prefix
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return _decided(prefix, f"no bytecode beside {', '.join(missing)}, and Python may not write it there", pruned)


def prune_unused(folder: Path, keep_days: float = KEEP_DAYS) -> list[str]:
    """Mark `folder` used now; remove its siblings (other interpreters' or library versions'
    bytecode, hundreds of MB each) that no process has used for `keep_days`. Returns their names."""
    import re
    import shutil
    import time

    try:
        (folder / USED).touch()
        siblings = list(folder.parent.iterdir())
    except OSError:
        return []
    cutoff, pruned = time.time() - keep_days * 86400, []
    for old in siblings:
        name = re.fullmatch(r"\.?([0-9a-f]{16})(\.removing-\d+)?", old.name)
        if old == folder or not name or old.name.startswith(".") != bool(name.group(2)):
            continue  # only folders this module names (or began to remove)
        try:
            marker = old / USED
            used = (marker if marker.exists() else old).stat().st_mtime
            if used >= cutoff or old.stat().st_uid != os.getuid():
                continue
            gone = old
            if not name.group(2):  # renamed first: a process starting now never reads a half-removed folder
                gone = old.with_name(f".{old.name}.removing-{os.getpid()}")
                old.rename(gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)
        pruned.append(name.group(1))
    return pruned


def switched_off(environ: MutableMapping[str, str]) -> bool:
    """Whether `environ` turns the cache off (RUNNER_BYTECODE_CACHE=0/off/false/no)."""
    return environ.get(SWITCH, "").strip().lower() in ("0", "off", "false", "no")


def _decided(prefix: Optional[str], reason: str, pruned: Iterable[str] = ()) -> Optional[str]:
    _state.update(prefix=sys.pycache_prefix, set_by_runner=prefix is not None, reason=reason)
    _state.pop("pruned", None)
    if pruned:  # the folders prune_unused removed
        _state["pruned"] = list(pruned)
    return prefix


def engine_bytecode() -> Optional[str]:
    """`use_cache` under the runner's cache folder, decided once a process (preload, then each engine
    of the run asks again); call before the engine's library is imported."""
    if _state["reason"] != UNDECIDED:  # once vLLM is imported, deciding again would change nothing
        return _state["prefix"] if _state["set_by_runner"] else None
    from runner.models import cache_root

    return use_cache(cache_root() / "pycache")


def state() -> dict:
    """This process's bytecode prefix (None: beside the sources), whether the runner set it, and why."""
    return dict(_state)
