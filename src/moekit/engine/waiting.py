"""One tier's waiting requests, in the order they are admitted: lowest `priority` first (vLLM's
field and convention: lower is served sooner, default 0), then first come, first served.

The deque-like face (append, [0], popleft, len, iteration, clear) is what the scheduler used
before priorities existed, so its admission loop reads the same.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator


class WaitingQueue:
    def __init__(self):
        self._heap: list[tuple[int, int, object]] = []  # (priority, arrival, request)
        self._arrivals = itertools.count()

    def append(self, request) -> None:
        heapq.heappush(self._heap, (request.priority, next(self._arrivals), request))

    def __getitem__(self, index: int):
        if index != 0:
            raise IndexError("only the next request (index 0) can be read")
        return self._heap[0][2]

    def popleft(self):
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator:
        """Every waiting request, in admission order."""
        return iter([request for _, _, request in sorted(self._heap, key=lambda item: item[:2])])

    def clear(self) -> None:
        self._heap.clear()
