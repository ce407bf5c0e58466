"""The Responses API's stored responses: the newest N, in memory, per server process."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


# The most the stored responses may hold, as JSON text, whatever their count: a client
# that stores long conversations one after another cannot grow the server's memory
# past it (the oldest go first).
MAX_STORED_BYTES = 128 * 1024 * 1024


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response as it was sent
    conversation: list[dict[str, Any]]  # every chat message up to and with the answer, no instructions
    # Every input item up to the answer (earlier responses' inputs and outputs first), as
    # GET /v1/responses/{id}/input_items lists them.
    input_items: list[dict[str, Any]] = field(default_factory=list)
    size: int = field(init=False)  # bytes, as JSON text (what the store's byte bound counts)

    def __post_init__(self) -> None:
        self.size = sum(len(json.dumps(part)) for part in (self.body, self.conversation, self.input_items))


class ResponseStore:
    """The newest ``capacity`` stored responses (and at most ``max_bytes`` of them), in
    memory, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.
    Owned by the event loop's thread."""

    def __init__(self, capacity: int, max_bytes: int = MAX_STORED_BYTES) -> None:
        if capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0 or stored.size > self.max_bytes:
            return
        self.delete(response_id)
        self._items[response_id] = stored
        self.bytes += stored.size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            _, oldest = self._items.popitem(last=False)
            self.bytes -= oldest.size

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        return True
