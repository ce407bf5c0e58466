"""WaitingQueue: preempted first, then groups take turns (fair queueing), arrival breaks ties."""

from __future__ import annotations

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.waiting_queue import WaitingQueue


def req(request_id: str, group: str = "") -> Request:
    return Request(request_id=request_id, prompt_token_ids=[1, 2], max_tokens=1, group=group,
                   sampling_params=SamplingParams(max_tokens=1))


def ids(queue: WaitingQueue) -> list[str]:
    return [r.request_id for r in queue]


def drain(queue: WaitingQueue) -> list[str]:
    out = []
    while queue:
        out.append(queue.pop().request_id)
    return out


def test_requests_of_their_own_groups_are_fifo() -> None:
    q = WaitingQueue()
    for rid in "abc":
        q.append(req(rid))
    assert q.peek().request_id == "a"
    assert drain(q) == ["a", "b", "c"]


def test_groups_take_turns() -> None:
    q = WaitingQueue()
    for i in range(4):
        q.append(req(f"big-{i}", group="big"))
    q.append(req("small", group="small"))
    q.append(req("other-0", group="other"))
    q.append(req("other-1", group="other"))
    assert ids(q) == ["big-0", "small", "other-0", "big-1", "other-1", "big-2", "big-3"]


def test_a_late_group_joins_the_current_round_instead_of_jumping_ahead() -> None:
    q = WaitingQueue()
    for i in range(6):
        q.append(req(f"a-{i}", group="a"))
    assert [q.pop().request_id for _ in range(3)] == ["a-0", "a-1", "a-2"]
    for i in range(3):
        q.append(req(f"b-{i}", group="b"))
    # a-3 is rank 3; b starts at the round last admitted (2), so b-0 goes first, then they alternate.
    assert drain(q) == ["b-0", "a-3", "b-1", "a-4", "b-2", "a-5"]


def test_preempted_requests_go_first_newest_first() -> None:
    q = WaitingQueue()
    q.append(req("new"))
    q.push_preempted(req("p1"))
    q.push_preempted(req("p2"))
    assert drain(q) == ["p2", "p1", "new"]


def test_remove_and_a_group_that_empties_starts_over_at_the_round() -> None:
    q = WaitingQueue()
    a0, a1, b0 = req("a-0", "a"), req("a-1", "a"), req("b-0", "b")
    for r in (a0, a1, b0):
        q.append(r)
    q.remove(a1)
    assert ids(q) == ["a-0", "b-0"] and len(q) == 2
    assert q.pop() is a0
    q.append(req("a-2", "a"))  # group a had nothing waiting: it starts at the round (0)
    assert drain(q) == ["b-0", "a-2"]


def test_a_request_skipped_by_peek_keeps_its_place() -> None:
    # The scheduler skips a request it may not admit yet (--max-loras) and admits one
    # behind it; the skipped one stays first, and later groups still join behind.
    q = WaitingQueue()
    for rid, group in [("a", "x"), ("b", "y"), ("c", "z")]:
        q.append(req(rid, group))
    assert q.peek(lambda r: r.request_id != "a").request_id == "b"
    assert q.peek(lambda r: False) is None
    assert q.pop(q.peek(lambda r: r.request_id == "c")).request_id == "c"
    q.append(req("d", "w"))
    assert q.pop().request_id == "a"
    assert drain(q) == ["b", "d"]
    assert WaitingQueue().peek() is None


def prio(request_id: str, priority: int, group: str = "") -> Request:
    return Request(request_id=request_id, prompt_token_ids=[1, 2], max_tokens=1, group=group,
                   sampling_params=SamplingParams(max_tokens=1, priority=priority))


def test_a_lower_priority_value_goes_first_and_groups_take_turns_within_it() -> None:
    q = WaitingQueue()
    for i in range(3):
        q.append(prio(f"batch-{i}", 5, group="batch"))
    q.append(prio("urgent", -1))
    for i in range(2):
        q.append(prio(f"big-{i}", 0, group="big"))
    q.append(prio("small", 0, group="small"))
    assert ids(q) == ["urgent", "big-0", "small", "big-1", "batch-0", "batch-1", "batch-2"]
    assert drain(q) == ["urgent", "big-0", "small", "big-1", "batch-0", "batch-1", "batch-2"]


def test_a_preempted_request_goes_first_within_its_priority_only() -> None:
    q = WaitingQueue()
    q.append(prio("new-0", 0))
    q.append(prio("new-1", 1))
    q.append(prio("new-2", 2))
    q.push_preempted(prio("preempted-1", 1))
    assert ids(q) == ["new-0", "preempted-1", "new-1", "new-2"]
