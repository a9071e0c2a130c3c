"""Merge the results files of one lease's bench.py processes (one per GPU stream) into one file.

Each stream writes its own JSON (bench/gpu.sh streams); the issue's keys need them side by side.
The merged file has the keys (medians of per-round ratios), the same keys over the warm rounds only
(`--warm-from R`: rounds before R paid a first torch.compile), and, for files given with `--extra`
(a later bench.py with --repeats 1, say), their rounds numbered after the main ones: kept as raw
runs and in `with_extra_rounds`, not in the main medians.

    python bench/merge.py --out bench/results/X.json --commit abc1234 --warm-from 2 \\
        e2e-0.json e2e-1.json --extra r4-0.json r4-1.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench import RATIO_KEYS, ratios, summarize  # noqa: E402
from bench.tasks import Task  # noqa: E402


def load_tasks(files: list[Path], first_round: int = 1) -> list[Task]:
    """Tasks from results files; rounds renumbered from first_round when it is not 1."""
    tasks = []
    for f in files:
        for r in json.loads(Path(f).read_text())["runs"]:
            r = dict(r)
            r["round"] = r["round"] + first_round - 1
            tasks.append(Task(r["case"], r["config"], r["round"], result=r))
    return tasks


def ranges(tasks: list[Task]) -> dict:
    """Each key's per-round ratios over these tasks: [median, min, max, n]; keys with no pair left out."""
    out = {}
    for key, (case, num, den, field, invert) in RATIO_KEYS.items():
        r = ratios([t for t in tasks if t.case == case], case, num, den, field, invert)
        if r["n"]:
            out[key] = [r["median"], r["min"], r["max"], r["n"]]
    return out


def merge(main: list[Path], extra: list[Path], warm_from: int) -> dict:
    tasks = load_tasks(main)
    rounds = max((t.round for t in tasks), default=0)
    more = load_tasks(extra, first_round=rounds + 1) if extra else []
    s = summarize(tasks)
    doc = {k: v for k, v in s.items() if k != "cases" and not (isinstance(v, list) and v[2] == 0) and v is not None}
    doc["warm_rounds_only"] = ranges([t for t in tasks if t.round >= warm_from])
    if more:
        doc["with_extra_rounds"] = ranges(tasks + more)
    doc["cases"] = s["cases"]
    doc["runs"] = [t.result for t in tasks + more]
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="results files of the planned rounds")
    ap.add_argument("--extra", nargs="*", type=Path, default=[], help="files of rounds run after those")
    ap.add_argument("--warm-from", type=int, default=2, help="first round in which every configuration was warm")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--date", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--note", action="append", default=[], help="a note for the file (repeatable)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    first = json.loads(a.files[0].read_text())
    head = {"machine": a.machine or first.get("machine"), "date": a.date or first.get("date"),
            "commit": a.commit or first.get("commit")}
    doc = head | merge(a.files, a.extra, a.warm_from) | {"notes": a.note}
    a.out.write_text(json.dumps(doc, indent=1))
    for key in RATIO_KEYS:
        if key in doc:
            print(f"{key:<34} {doc[key]} {doc.get(key + '_range')}  warm {doc['warm_rounds_only'].get(key)}")


if __name__ == "__main__":
    main()
