"""Which on-disk caches a run wrote to: a diagnostic for start-up time that a run pays and the next
does not (a first run's `LLM(...)` took ~9 s longer than later runs' with its compile loaded from
the cache, leases of e10c990 and e916717). A run that adds files to a compile or kernel cache was
building something the next run finds."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

# How deep under a cache root a new file is counted: deep enough to name the kind of cache and its
# key (torch_compile_cache/<hash>/rank_0_0, triton/<kernel hash>), shallow enough to stay short.
DEPTH = 3
TOP = 12


def roots() -> list[Path]:
    """The caches vLLM, torch, Triton and the runner keep on this machine."""
    home = Path.home()
    env = [os.environ.get(k) for k in ("VLLM_CACHE_ROOT", "RUNNER_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")]
    user = os.environ.get("USER") or "root"
    found = [Path(p) for p in env if p] + [home / ".triton", home / ".cache", Path(f"/tmp/torchinductor_{user}")]
    unique: list[Path] = []
    for p in found:
        if p not in unique:
            unique.append(p)
    return unique


def snapshot() -> set[str]:
    """Every file under the cache roots, by path."""
    files: set[str] = set()
    for root in roots():
        for d, _, names in os.walk(root):
            files.update(os.path.join(d, n) for n in names)
    return files


def added(before: set[str], after: set[str]) -> dict[str, int]:
    """New files counted by their folder (DEPTH levels below their cache root), most first."""
    counts: Counter = Counter()
    for path in after - before:
        root = next((r for r in roots() if path.startswith(str(r) + os.sep)), None)
        rel = Path(path).relative_to(root) if root else Path(path)
        counts[str(Path(root or "/", *rel.parent.parts[:DEPTH]))] += 1
    return dict(counts.most_common(TOP))
