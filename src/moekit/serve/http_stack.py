"""Which event loop and HTTP parser uvicorn runs `moekit serve` on: uvloop and httptools (both
dependencies of moekit), or asyncio's own loop and h11 where one of them is not installed.

Why these two: at one client on two cores the event loop's Python per streamed token is taken from
the decode step's own threads (the loop shares the cores and the GIL with them). With h11 and
asyncio the loop ran 153 Python calls a token; with httptools and uvloop 57 (docs/BENCHMARKS.md,
"The scheduler's and the event loop's share of a served token at c = 1"). uvicorn's `auto` picks
them too when it finds them, but silently falls back when it does not; naming them makes the
server say which it runs, and why a slower one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class HttpStack:
    loop: str  # uvicorn.Config's loop=
    http: str  # uvicorn.Config's http=
    notes: tuple[str, ...] = ()  # one line per fallback, for the server's start-up notes


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def http_stack(have: Callable[[str], bool] = installed) -> HttpStack:
    """uvloop + httptools where `have` finds them; asyncio / h11 in place of a missing one, with a note."""
    notes = []
    loop, http = "uvloop", "httptools"
    if not have("uvloop"):
        loop = "asyncio"
        notes.append("uvloop is not installed: serving on asyncio's event loop (more of each token's CPU on the "
                     "loop; pip install uvloop)")
    if not have("httptools"):
        http = "h11"
        notes.append("httptools is not installed: parsing HTTP with h11 (pip install httptools)")
    return HttpStack(loop=loop, http=http, notes=tuple(notes))
