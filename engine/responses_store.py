"""The responses an engine keeps for the Responses API (``store``): in memory, the least recently used
dropped first once there are ``capacity`` of them, so that a busy engine's memory stays bounded (vLLM's
store, with VLLM_ENABLE_RESPONSES_API_STORE=1, grows without end)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 4096


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response: the object served, the chat its prompt was rendered from (history,
    instructions and input), which a ``previous_response_id`` continues, and the items it was generated
    from, which ``GET /v1/responses/{id}/input_items`` lists (engine/responses_items.py)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    input_items: tuple[dict[str, Any], ...] = ()


class ResponseStore:
    """Responses by id, at most ``capacity`` of them (0: none kept); reading one makes it the most recent."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if not self.capacity:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
