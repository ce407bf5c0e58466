"""The Responses API's stored responses: the newest N, in memory, per server process."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response as it was sent
    conversation: list[dict[str, Any]]  # every chat message up to and with the answer, no instructions


class ResponseStore:
    """The newest ``capacity`` stored responses, in memory, for ``previous_response_id``
    and ``GET``/``DELETE /v1/responses/{id}``. Owned by the event loop's thread."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
