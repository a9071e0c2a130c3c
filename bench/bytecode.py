"""How long `from vllm import LLM` takes in a fresh process, with and without a bytecode cache.

Python compiles every module it imports from source unless it finds bytecode: beside the source
(`__pycache__`) or, with PYTHONPYCACHEPREFIX, under that folder. Where the packages came without
bytecode and the environment forbids writing it (PYTHONDONTWRITEBYTECODE=1, as in the GPU image; or
a read-only site-packages), every run compiles torch, sympy and vLLM again. The runner then keeps
bytecode under its own cache folder (runner/bytecode.py). This times, interleaved, in whole processes:

  default   the environment as it is
  prefix    PYTHONPYCACHEPREFIX=<a fresh folder>, writing allowed: the first run compiles and writes,
            the later ones read (what the runner does for itself after its first run)

    python bench/bytecode.py --repeats 3 --out bench/results/X.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runner.bytecode import bytecode_beside  # noqa: E402

IMPORT = "import vllm; from vllm import LLM"


def timed(env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", IMPORT], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"the import failed: {proc.stderr[-1500:]}")
    return round(time.perf_counter() - t0, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="pyc-"))
    base = dict(os.environ)
    base.pop("PYTHONPYCACHEPREFIX", None)
    prefixed = {k: v for k, v in base.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPYCACHEPREFIX": str(folder)}
    runs = {"default": [], "prefix_first": [], "prefix": []}
    try:
        runs["prefix_first"].append(timed(prefixed))
        for _ in range(a.repeats):
            runs["default"].append(timed(base))
            runs["prefix"].append(timed(prefixed))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = {k: round(statistics.median(v), 2) for k, v in runs.items() if v}
    doc = {"what": "seconds of `" + IMPORT + "` in a fresh process", "python": sys.version.split()[0],
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "PYTHONDONTWRITEBYTECODE": base.get("PYTHONDONTWRITEBYTECODE"),
           # None: not found as plain source files
           "bytecode_beside": {p: beside if origin else None
                               for p in ("torch", "sympy", "vllm", "transformers")
                               for origin, beside in [bytecode_beside(p)]},
           "runs_s": runs, "median_s": med}
    print(f"{'config':<14} {'median s':>9}  runs")
    for k, v in runs.items():
        print(f"{k:<14} {med[k]:>9}  {v}")
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
