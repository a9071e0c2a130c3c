"""The Feed (runner/engines/feed.py) without vLLM: prefix warming, admission, in-flight limits."""
from __future__ import annotations

from runner.engines.admission import KvBudget
from runner.engines.base import Request
from runner.engines.feed import Feed


def req(row, group="g", prompt=100, cacheable=64):
    return Request(row, group, list(range(prompt)), 32, cacheable)


def feed(blocks=None, max_in_flight=16, per_step=8, warm=True):
    # Admission by the sum of peaks alone: the projection has its own tests (test_adapt.py).
    return Feed(KvBudget(blocks, 16, project=False), max_in_flight, per_step, warm, clock=lambda: 0.0)


def send_all(f, rids):
    sent = f.to_send()
    for a in sent:
        rids.append(a.request.row_id)
        f.sent(a.request.row_id, a)
    return sent


def test_a_groups_first_request_goes_alone_until_it_produces_output():
    f = feed()
    f.add([req("a1"), req("a2"), req("a3"), req("b1", group="h")])
    sent = send_all(f, [])
    assert [(a.request.row_id, a.leader) for a in sent] == [("a1", True), ("b1", True)]
    assert send_all(f, []) == []  # a2, a3 wait for a1's prefix
    f.progressed("a1")  # a1 produced a token: its prefix is in the cache
    assert [a.request.row_id for a in send_all(f, [])] == ["a2", "a3"]
    f.add([req("a4")])
    assert [(a.request.row_id, a.leader) for a in send_all(f, [])] == [("a4", False)]  # warm now: goes at once


def test_without_warming_a_group_goes_at_once():
    f = feed(warm=False)
    f.add([req("a1"), req("a2")])
    assert [(a.request.row_id, a.leader) for a in send_all(f, [])] == [("a1", False), ("a2", False)]


def test_a_rejected_leader_lets_its_group_go_cold():
    f = feed()
    f.add([req("a1"), req("a2")])
    leader = f.to_send()[0]
    f.rejected(leader)
    assert [a.request.row_id for a in send_all(f, [])] == ["a2"]
    assert f.budget.used == f.budget.tickets[next(iter(f.budget.tickets))].blocks  # a1's blocks were freed


def test_room_counts_everything_queued_and_steps_are_bounded():
    f = feed(max_in_flight=5, per_step=3)
    assert f.room() == 3
    f.add([req(f"r{i}", group=f"g{i}") for i in range(5)])
    assert f.room() == 0
    assert len(send_all(f, [])) == 3  # per_step at a time
    assert len(send_all(f, [])) == 2
    for a in list(f.in_flight):
        f.finished(a, 10)
    assert f.idle() and f.room() == 3


def test_requests_wait_in_order_for_kv_blocks():
    """20 blocks: each request needs 7 beyond the shared prefix (4): two fit, the third waits."""
    f = feed(blocks=20, warm=False)
    f.add([req("r1", prompt=100, cacheable=64), req("r2", prompt=100, cacheable=64), req("r3", prompt=100, cacheable=64)])
    first = send_all(f, [])
    assert [a.request.row_id for a in first] == ["r1", "r2"] and f.budget.deferred == 1
    f.finished("r1", 20)
    assert [a.request.row_id for a in send_all(f, [])] == ["r3"]
