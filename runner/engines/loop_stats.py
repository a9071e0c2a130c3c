"""Where the driver's time goes while it feeds vLLM, stored with the run's stats (the `loop` of an
engine's adaptation): waiting on the engine core in step(), adding requests, the caller's own work
between polls, how full the engine was kept, and vLLM's KV usage beside the runner's own count."""
from __future__ import annotations

from typing import Optional


class LoopStats:
    """Sums kept per step; `summary` turns them into the stored means."""

    def __init__(self):
        self.sums = {"steps": 0, "step_wait_s": 0.0, "add_request_s": 0.0, "between_polls_s": 0.0,
                     "max_in_flight_seen": 0, "in_flight_step_sum": 0, "held_step_sum": 0,
                     # vLLM's KV usage against the runner's own count, sampled with the metrics scan
                     # while requests are in flight: how much of the cache admission leaves unused
                     "kv_samples": 0, "kv_usage_sum": 0.0, "kv_usage_max": 0.0, "kv_counted_sum": 0.0}

    def add(self, key: str, seconds: float) -> None:
        self.sums[key] += seconds

    def sent(self, in_flight: int) -> None:
        self.sums["max_in_flight_seen"] = max(self.sums["max_in_flight_seen"], in_flight)

    def stepped(self, in_flight: int, held: int) -> None:
        """Per-step sums: their means say how full the engine was kept and what waited for a leader."""
        self.sums["steps"] += 1
        self.sums["in_flight_step_sum"] += in_flight
        self.sums["held_step_sum"] += held

    def kv_sample(self, usage: float, counted: Optional[float]) -> None:
        """vLLM's KV usage (0-1) and the budget's own count of it (None where it keeps none)."""
        self.sums["kv_samples"] += 1
        self.sums["kv_usage_sum"] += usage
        self.sums["kv_usage_max"] = max(self.sums["kv_usage_max"], usage)
        if counted is not None:
            self.sums["kv_counted_sum"] += counted

    def summary(self, counted: bool) -> dict:
        """The stored form; counted: whether the budget kept its count (the projection is on)."""
        loop = {k: round(v, 3) if isinstance(v, float) else v for k, v in self.sums.items()}
        steps = max(self.sums["steps"], 1)
        n = loop["kv_samples"]  # 0: no KV budget, or no scan while requests were in flight
        usage, kv_counted = loop.pop("kv_usage_sum"), loop.pop("kv_counted_sum")
        return loop | {"mean_in_flight": round(self.sums["in_flight_step_sum"] / steps, 1),
                       "mean_held": round(self.sums["held_step_sum"] / steps, 1),
                       "mean_kv_usage": round(usage / n, 3) if n else None,
                       "mean_kv_counted": round(kv_counted / n, 3) if n and counted else None}
