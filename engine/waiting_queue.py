"""The scheduler's waiting queue: fair turns between groups of requests.

A group is what one client asked for at once (the server makes one group of
the prompts of an API request; ``n`` samples share their prompt's group).
Plain FIFO would let one request of 10,000 prompts hold the engine while a
request that arrived a second later waits behind all of them. Here each group
takes turns, as in fair queueing: the k-th waiting request of a group gets
rank ``round + k`` (``round`` is the rank last admitted, so a new group joins
the current round instead of jumping ahead of older groups), ranks are served
in order and arrival breaks ties. Preempted requests come before everything
else, the most recently preempted first, as the scheduler always did.

Above all that stands a request's priority (vLLM's, with ``--scheduling-policy
priority``; lower first): the order above holds within each priority, and a
preempted request waits behind new requests of a higher priority (a lower
value). Without the policy every priority is 0 and this changes nothing.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator

from engine.request import Request

# (priority, class, rank, arrival): class 0 for preempted requests, 1 for the rest.
_Key = tuple[int, int, int, int]


class WaitingQueue:
    """Requests waiting for admission, ordered as the module docstring says."""

    def __init__(self) -> None:
        self._keys: list[_Key] = []  # sorted; parallel to _requests
        self._requests: list[Request] = []
        self._key_of: dict[str, _Key] = {}
        self._arrivals = itertools.count()
        self._round = 0
        self._next_rank: dict[str, int] = {}  # per group with waiting requests
        self._waiting_in_group: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests))

    def append(self, request: Request) -> None:
        """Queue a new request behind the waiting requests of its group."""
        group = request.group
        rank = max(self._next_rank.get(group, 0), self._round)
        self._next_rank[group] = rank + 1
        self._insert((request.priority, 1, rank, next(self._arrivals)), request)

    def push_preempted(self, request: Request) -> None:
        """Queue a preempted request ahead of everything of its priority (the newest
        preempted first)."""
        self._insert((request.priority, 0, -next(self._arrivals), 0), request)

    def peek(self, allowed: Callable[[Request], bool] | None = None) -> Request | None:
        """The request to admit next: the first in order that ``allowed`` accepts (all
        by default); None when there is none."""
        if allowed is None:
            return self._requests[0] if self._requests else None
        return next((r for r in self._requests if allowed(r)), None)

    def pop(self, request: Request | None = None) -> Request:
        """Remove and return ``request`` (default: the first), admitted: the rounds go on
        from its rank."""
        at = 0 if request is None else bisect.bisect_left(self._keys, self._key_of[request.request_id])
        request = self._requests[at]
        key = self._keys[at]
        if key[1] == 1:  # (max: one admitted past a skipped one came from a later round)
            self._round = max(self._round, key[2])
        self._remove_at(at)
        return request

    def remove(self, request: Request) -> None:
        """Take a waiting request out (it finished or was aborted while waiting)."""
        key = self._key_of[request.request_id]
        self._remove_at(bisect.bisect_left(self._keys, key))

    def _insert(self, key: _Key, request: Request) -> None:
        assert request.request_id not in self._key_of, request.request_id
        at = bisect.bisect_right(self._keys, key)
        self._keys.insert(at, key)
        self._requests.insert(at, request)
        self._key_of[request.request_id] = key
        group = request.group
        self._waiting_in_group[group] = self._waiting_in_group.get(group, 0) + 1

    def _remove_at(self, at: int) -> None:
        request = self._requests.pop(at)
        self._keys.pop(at)
        del self._key_of[request.request_id]
        group = request.group
        left = self._waiting_in_group[group] - 1
        if left:
            self._waiting_in_group[group] = left
        else:  # the group's next request starts at the round then current
            del self._waiting_in_group[group]
            self._next_rank.pop(group, None)
