"""A hot swap's canary: the new weights of swapped experts serve a set share of new requests first.

`POST /admin/experts/{layer}/{expert}?canary=0.1` stages the expert's new weights without switching
them in for everyone: every 10th new request (exactly the share, by a running count) runs on them,
the others on the served weights, side by side in one running batch. A request can ask for either
side with the header `x-moekit-canary: 1` (or `0`). `…/promote` makes the canary weights the served
ones (a swap, with its rollback); `…/rollback` while the canary runs ends the canary.

How rows of both sides share a step: the batch runs on the served weights; each canary row is then
run again alone (engine.scheduler._decode_alone) with the canary weights put in for that forward
(applied()) and taken out after, between the same two steps, so no other row sees them.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

from moekit.serve.errors import bad_request

HEADER = "x-moekit-canary"


@dataclass
class Canary:
    share: float  # of new requests, in (0, 1)
    experts: dict = field(default_factory=dict)  # (layer, expert) -> (RoutedExperts, staged weights)
    seen: int = 0  # new requests counted since the canary began
    assigned: int = 0

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The canary weights in place for the with-block, the served ones back after it."""
        served = [(module, e, module.replace_expert(e, staged)) for (_, e), (module, staged) in self.experts.items()]
        try:
            yield
        finally:
            for module, e, old in reversed(served):
                module.replace_expert(e, old)

    def assign(self) -> bool:
        """Whether the next new request runs on the canary: exactly `share` of them over time."""
        n = self.seen
        self.seen += 1
        on = math.floor((n + 1) * self.share) > math.floor(n * self.share)
        self.assigned += int(on)
        return on


def parse_share(text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0 < share < 1:
        raise bad_request(f"canary must be a share of requests in (0, 1), e.g. 0.1; got {text!r}", "canary")
    return share


def on_canary(canary: Optional[Canary], header: Optional[str]) -> bool:
    """A new request's side: the header's choice when sent, else the canary's running count."""
    if canary is None:
        return False
    if header is not None:
        if header.strip() not in ("0", "1"):
            raise bad_request(f"the {HEADER} header is 1 (the canary) or 0 (the served weights), got {header!r}", HEADER)
        return header.strip() == "1"
    return canary.assign()
