"""The token stream's two cheap parts: the engine thread's hand-off of items to the event loop, and
the SSE frame of a plain token.

Hand-off. The scheduler's callbacks run on the engine thread; a reply reads on the event loop. Each
reply has a Mailbox (a deque the engine thread appends to) and every mailbox of a server shares
one Dispatcher, which wakes the loop once for whatever arrived since its last wake: one
`call_soon_threadsafe` (a lock and a self-pipe write, then an epoll wake-up) per burst of items,
not one per token and per request, and no asyncio.Queue with its future per item. While the loop
is busy elsewhere items pile up, and the reply then takes them all at once (one SSE write for
several tokens). At c = 1 a token's Python on the loop is what its step loses on two cores, since
the loop shares them with the step's own threads.

Frames. A streamed token's chunk differs from the next one's only in its text and its id, so a
reply builds it from a template cut out of the reference chunk (`json.dumps` of the whole object,
made once per choice with placeholders): the text's JSON string and the id go in between. The
template is used only where the chunk carries nothing else (no logprobs, no usage so far, no echo);
tests/serve/test_streaming.py checks that it gives the reference's bytes.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import Callable, Optional

TEXT_MARK = "\x00moekit-text\x00"  # placeholders no real chunk holds: json.dumps writes \u0000 for NUL
ID_MARK = -(10**18) - 7


@dataclass(eq=False)
class Mailbox:
    """One reply's items from the engine thread, (choice index, kind, value), in order. `abandoned`:
    set on the loop when nobody reads the reply any more: items then go to it as they come."""

    items: deque = field(default_factory=deque)
    waiter: Optional[object] = None  # the asyncio.Future the reader awaits, while it waits
    abandoned: Optional[Callable[[tuple], None]] = None

    def wake(self) -> None:
        """On the loop: the reader goes on (or, once abandoned, the items go straight on)."""
        if self.abandoned is not None:
            while self.items:
                self.abandoned(self.items.popleft())
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self, loop) -> list[tuple]:
        """On the loop: every item that has arrived, waiting for at least one."""
        while not self.items:
            self.waiter = loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out = []
        while self.items:  # popleft, not a copy and clear: the engine thread may append meanwhile
            out.append(self.items.popleft())
        return out

    def drain(self) -> list[tuple]:
        out = []
        while self.items:
            out.append(self.items.popleft())
        return out


class Dispatcher:
    """Wakes the event loop once per burst of items, for every mailbox that got some."""

    def __init__(self, loop):
        self.loop = loop
        self._dirty: deque = deque()
        self._armed = False

    def put(self, box: Mailbox, item: tuple) -> None:
        """On the engine thread: `item` into `box`; a wake of the loop unless one is on its way.
        The item goes in before the flag is read, so a flush that has already cleared the flag
        either finds it or is followed by the wake this call posts."""
        box.items.append(item)
        self._dirty.append(box)
        if not self._armed:
            self._armed = True
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed (a shutdown past its grace): nobody reads any more
                pass

    def _flush(self) -> None:
        self._armed = False
        woken = set()
        while self._dirty:
            box = self._dirty.popleft()
            if box not in woken:
                woken.add(box)
                box.wake()


@dataclass(frozen=True)
class FrameTemplate:
    """A streamed token's SSE chunk around its text and id: head + JSON(text) + middle + id + tail
    (middle and tail empty when the chunk lists no token ids)."""

    head: str
    middle: str
    tail: str
    with_id: bool

    def frame(self, text: str, token: int) -> str:
        # json.dumps(text, ensure_ascii=False) of a str, without the JSONEncoder it builds per call.
        quoted = encode_basestring(text)
        if self.with_id:
            return f"{self.head}{quoted}{self.middle}{token}{self.tail}"
        return f"{self.head}{quoted}{self.middle}"


def cut_template(reference: str, with_id: bool) -> Optional[FrameTemplate]:
    """A chunk made by the reference with TEXT_MARK as its text (and ID_MARK as its one token id)
    → its template; None if a placeholder is not there exactly once (the chunk is built some other
    way, and the reference then makes every one)."""
    text = json.dumps(TEXT_MARK, ensure_ascii=False)
    if reference.count(text) != 1:
        return None
    head, _, rest = reference.partition(text)
    if not with_id:
        return FrameTemplate(head, rest, "", False)
    mark = f"[{ID_MARK}]"
    if rest.count(mark) != 1:
        return None
    middle, _, tail = rest.partition(mark)
    return FrameTemplate(head, middle + "[", "]" + tail, True)
