"""Which requests go to the engine, and when (no vLLM in here: unit-tested on its own).

At most `max_in_flight` requests are in the engine or waiting for it, and only while the KV
budget holds them (runner/engines/admission.py). With `warm_prefix`, the first request of a group
goes alone and the rest of its group waits until that leader has produced a token: requests
scheduled in the same step as their prefix is computed cannot hit the cache, so without the wait
a group's whole first wave would miss it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from runner.engines.admission import KvBudget
from runner.engines.base import Request


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
                 clock: Callable[[], float]):
        self.budget, self.max_in_flight, self.per_step = budget, max_in_flight, per_step
        self.warm_prefix, self.clock = warm_prefix, clock
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
        while self.waiting and len(out) < self.per_step:
            req = self.waiting[0]
            if not self.budget.can_admit(req):
                self.budget.deferred += 1
                break
            self.waiting.popleft()
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
        return out

    def sent(self, rid: str, admitted: Admitted) -> None:
        self.budget.submitted(admitted.ticket)  # its tokens start growing now, not while held
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

    def finished(self, rid: str, completion_tokens: Optional[int]) -> InFlight:
        self.progressed(rid)
        done = self.in_flight.pop(rid)
        self.budget.release(done.admitted.ticket, completion_tokens)
        return done

    def _open(self, key: str) -> None:
        self._warm.add(key)
        followers = self._held.pop(key, [])
        self._n_held -= len(followers)
        self._released += followers
