"""The benchmark's scheduler: tasks in order on free GPUs, one process per GPU (several for
multi-GPU configurations; a Ray run has the machine to itself). The first run of each engine setup
runs alone, so that two processes never fill vLLM's compile cache at once; a runner configuration
that reuses a calibration waits for its case's first run to store one; a multi-GPU run waits for its
round's single-GPU runs, and the next round's runs wait for it."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from bench.tasks import ROOT, Task, execute, reuses_first_run


def gpu_ids(a) -> list[str]:
    if a.gpus != "auto":  # on the CPU: slots, to try multi-GPU configurations' code paths
        return a.gpus.split(",")
    if a.platform == "cpu":
        return [""]
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True)
    return [x.strip() for x in out.stdout.splitlines() if x.strip()] or ["0"]


class Schedule:
    """Tasks waiting, running and done, under one lock (each task runs in a thread of its own)."""

    def __init__(self, a, tasks: list[Task], on_done: Callable[[], None]):
        self.a, self.on_done = a, on_done
        self.free, self.lock = gpu_ids(a), threading.Lock()
        self.machine = len(self.free)
        self.seeds: dict = {}  # case, or (case, config), -> a database holding that first calibration
        self.warm: set = set()  # compile keys whose first run finished
        self.compiling: set = set()
        self.pending = [t for t in tasks if t.gpus <= len(self.free)]
        for t in tasks:
            if t.gpus > len(self.free):
                t.result = {"error": f"needs {t.gpus} GPUs; this machine has {len(self.free)}"}
        self.active: list[Task] = []
        self.t_start = time.monotonic()

    def ready(self, t: Task) -> bool:
        if reuses_first_run(t) and t.case not in self.seeds:  # wait for a first run to store its calibration
            # this round's or an earlier one's: a later round's waits for this run (below), a deadlock
            if any(o.case == t.case and o.config == "runner_first" and o.round <= t.round
                   for o in self.pending + self.active):
                return False
        if t.gpus > 1 and any(o.gpus == 1 and o.round <= t.round for o in self.pending):
            return False  # a multi-GPU run waits for its round's single-GPU runs
        if any((o.gpus > 1 or o.alone) and o.round < t.round for o in self.pending):
            # and the next round's wait for it (or a Ray run, which needs every GPU free): else they
            # take each GPU as it frees, and such runs wait for the plan's last single-GPU run
            return False
        return t.compile_key in self.warm or t.compile_key not in self.compiling

    def start_ready(self) -> list[threading.Thread]:
        """Start every pending task that is ready and has its GPUs free (called under the lock)."""
        started = []
        for t in list(self.pending):
            # A Ray run has the machine to itself (a neighbour would slow one replica count's runs only)
            need = self.machine if t.alone else t.gpus
            if need <= len(self.free) and self.ready(t):
                ids = [self.free.pop(0) for _ in range(need)]
                self.pending.remove(t)
                self.active.append(t)
                if t.compile_key not in self.warm:
                    self.compiling.add(t.compile_key)
                t.gpu_ids, t.started_s = ",".join(ids[:t.gpus]), round(time.monotonic() - self.t_start, 1)
                th = threading.Thread(target=self.work, args=(t, ids), daemon=True)
                th.start()
                started.append(th)
        return started

    def work(self, t: Task, ids: list[str]) -> None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=t.gpu_ids, VLLM_LOGGING_LEVEL="INFO",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        try:
            t.result = execute(self.a, t, self.seeds, env)
        except Exception as exc:  # a timeout or a broken run: recorded, the plan goes on
            t.result = {"error": f"{exc.__class__.__name__}: {exc}"}
        with self.lock:
            self.active.remove(t)
            self.free.extend(ids)
            self.compiling.discard(t.compile_key)
            if "error" not in t.result:
                self.warm.add(t.compile_key)
            self.on_done()
        print(f"{t.case} {t.config} r{t.round} gpu {t.gpu_ids}: " + _outcome(t.result), file=sys.stderr, flush=True)


def _outcome(result: dict) -> str:
    """A finished run in one line: its time and speed, and its outputs (rows valid, vLLM's finish
    reasons), so that a faster setting that changes outputs shows while the lease runs."""
    if "error" not in result:
        finish = ", ".join(f"{k} {v}" for k, v in sorted((result.get("finish_reasons") or {}).items()))
        return (f"{result['process_s']:.1f} s, {result['documents_per_s']:.1f} doc/s, "
                f"{result.get('rows_valid')}/{result.get('rows')} valid" + (f" ({finish})" if finish else ""))
    lines = result["error"].strip().splitlines()
    return "ERROR " + lines[-1][:200] if lines else "ERROR"


def run_schedule(a, tasks: list[Task], deadline: Optional[float], on_done: Callable[[], None]) -> None:
    """Run tasks in order on free GPUs until done or past the deadline (running ones finish)."""
    s = Schedule(a, tasks, on_done)
    running: list[threading.Thread] = []
    while True:
        with s.lock:
            running = [th for th in running if th.is_alive()]
            if not s.pending and not running:
                return
            if deadline and time.monotonic() > deadline:
                if not running:
                    return
            else:
                running += s.start_ready()
        time.sleep(0.5)
