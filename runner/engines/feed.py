"""Which requests go to the engine, and when (no vLLM in here: unit-tested on its own).

At most `max_in_flight` requests are in the engine or waiting for it, and only while the KV
budget holds them (runner/engines/admission.py). With `warm_prefix`, the first request of a group
goes alone and the rest of its group waits until that leader has produced a token: requests
scheduled in the same step as their prefix is computed cannot hit the cache, so without the wait
a group's whole first wave would miss it. Where the KV budget binds, admissions may wait to go
in together, so that fewer engine steps prefill (runner/engines/cadence.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from runner.engines.admission import KvBudget
from runner.engines.base import Request
from runner.engines.cadence import Cadence


@dataclass
class Admitted:
    request: Request
    ticket: int  # its KV budget ticket
    leader: bool  # the first request of its group: its prefill warms the group's prefix


@dataclass
class InFlight:
    admitted: Admitted
    sent_at_s: float


class Feed:
    def __init__(self, budget: KvBudget, max_in_flight: int, per_step: int, warm_prefix: bool,
                 clock: Callable[[], float], waves: bool = False):
        self.budget, self.max_in_flight, self.per_step = budget, max_in_flight, per_step
        self.warm_prefix, self.clock = warm_prefix, clock
        self.cadence = Cadence(waves, clock)
        self._bound = False  # the last admission attempt stopped at a request the KV budget refused
        self.waiting: deque[Request] = deque()  # submitted, not admitted yet
        self.in_flight: dict[str, InFlight] = {}  # engine request id -> what was sent
        self._held: dict[str, list[Admitted]] = {}  # group -> admitted requests waiting for their leader
        self._n_held = 0
        self._warm: set[str] = set()  # groups whose prefix is computed
        self._leaders: dict[str, str] = {}  # engine request id -> the group it is warming
        self._released: list[Admitted] = []  # followers whose leader is done, to send next

    def room(self) -> int:
        """How many more requests to take now: enough to fill max_in_flight, per_step at a time."""
        queued = len(self.waiting) + len(self.in_flight) + self._n_held + len(self._released)
        return max(min(self.max_in_flight - queued, self.per_step), 0)

    def held(self) -> int:
        """Admitted requests waiting for their group's leader."""
        return self._n_held

    def idle(self) -> bool:
        return not (self.waiting or self.in_flight or self._n_held or self._released)

    def add(self, requests: list[Request]) -> None:
        self.waiting.extend(requests)

    def to_send(self) -> list[Admitted]:
        """Requests to send now: followers released by their leader, then waiting requests while
        the KV budget admits them (in order: the first that does not fit waits, and so do the rest)."""
        out, self._released = self._released, []
        # Waves only where blocks bind: a filling engine (the start) takes what fits at once, and
        # the pace (admission.py) spreads admissions out on purpose.
        if self._waves_apply() and self.cadence.hold(len(self.in_flight), len(self.waiting)):
            return out
        self._bound, taken = False, False
        while self.waiting and len(out) < self.per_step:
            req = self.waiting[0]
            if not self.budget.can_admit(req):
                self.budget.deferred += 1
                self._bound = True  # for blocks or the pace: _waves_apply tells them apart
                break
            self.waiting.popleft()
            taken = True
            admitted = Admitted(req, self.budget.admit(req), leader=False)
            key = req.group_key
            if self.warm_prefix and key not in self._warm:
                if key in self._held:
                    self._held[key].append(admitted)
                    self._n_held += 1
                    continue
                self._held[key] = []
                admitted.leader = True
            out.append(admitted)
        if taken:
            self.cadence.gathered()
        return out

    def sent(self, rid: str, admitted: Admitted) -> None:
        self.budget.submitted(admitted.ticket)  # its tokens start growing now, not while held
        req = admitted.request  # a leader prefills its group's head too
        self.cadence.sent(len(req.prompt_token_ids) if admitted.leader else self.budget.unshared(req))
        self.in_flight[rid] = InFlight(admitted, self.clock())
        if admitted.leader:
            self._leaders[rid] = admitted.request.group_key

    def rejected(self, admitted: Admitted) -> None:
        """The engine refused the request: free its blocks; a rejected leader's group goes on cold."""
        self.budget.release(admitted.ticket, None)
        if admitted.leader:
            self._open(admitted.request.group_key)

    def progressed(self, rid: str) -> None:
        """The request produced output: if it led a group, its prefix is cached now."""
        key = self._leaders.pop(rid, None)
        if key is not None:
            self._open(key)

    def _waves_apply(self) -> bool:
        """Blocks bind, the pace is off, and every request sent runs at once: with more in flight
        than vLLM runs (max_num_seqs), vLLM queues them and prefills each as a slot frees, whenever
        the runner sent it, so holding them back would not gather prefills into fewer steps."""
        running = self.budget.max_running
        return (self._bound and not self.budget.pacing()
                and (running is None or len(self.in_flight) < running))

    def stepped(self) -> None:
        """The engine made a step: its duration goes to the wave's fit where waves apply (a filling,
        draining or queueing engine's steps would mislead the fit)."""
        self.cadence.stepped(len(self.in_flight), record=self._waves_apply())

    def finished(self, rid: str, completion_tokens: Optional[int]) -> InFlight:
        self.progressed(rid)
        self.cadence.finished()
        done = self.in_flight.pop(rid)
        self.budget.release(done.admitted.ticket, completion_tokens)
        return done

    def _open(self, key: str) -> None:
        self._warm.add(key)
        followers = self._held.pop(key, [])
        self._n_held -= len(followers)
        self._released += followers
