"""Signs of life through the rendezvous store: which rank stopped answering.

A failed gloo collective says that a peer failed, not which one; a stopped rank (SIGSTOP, a swapped-out
machine, a deadlock) does not even close its sockets, so rank 0's small broadcasts keep succeeding
into the kernel's buffers while it is idle. So every follower adds 1 to its own counter in the
store (the TCPStore the ranks met at: this process's, or torchrun's) every `period_s`, from a thread
of its own, and rank 0 watches the counters. A counter is compared with itself, never a clock with
another machine's, so clock skew cannot blame a rank. The rank whose counter stopped first is the
one at fault: the ranks that merely waited on it stop later, when their own timeout runs out.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

from moekit.dist.group import LOOPBACK, Rank

KEY = "moekit/alive/{rank}"


def beat_period(timeout_s: float) -> float:
    """Often enough that a rank silent for a small part of --ep-timeout is noticed."""
    return max(0.05, min(0.5, timeout_s / 20))


def store_client(me: Rank, timeout_s: float):
    """A connection of its own to the store the ranks met at (a thread must not share the process
    group's): the self-launched ranks' loopback store, or torchrun's (MASTER_ADDR:MASTER_PORT)."""
    from torch.distributed import TCPStore

    host, port = (LOOPBACK, me.store_port) if me.store_port is not None else (
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


@dataclass
class Beat:
    """A follower's sign of life: its counter in the store, raised every period until stopped."""

    me: Rank
    timeout_s: float
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> "Beat":
        store = store_client(self.me, self.timeout_s)
        key, period = KEY.format(rank=self.me.rank), beat_period(self.timeout_s)

        def run() -> None:
            while not self.done.is_set():
                try:
                    store.add(key, 1)
                except Exception:  # noqa: BLE001 - the store's host is gone: the collectives fail too
                    return
                self.done.wait(period)

        threading.Thread(target=run, name=f"moekit-beat-{self.me.rank}", daemon=True).start()
        return self

    def stop(self) -> None:
        self.done.set()


@dataclass
class Watch:
    """Rank 0's view of the followers' counters: when each last moved (time.monotonic())."""

    me: Rank
    timeout_s: float
    seen: dict = field(default_factory=dict)  # rank → (its counter, when it last changed)
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "Watch":
        store = store_client(self.me, self.timeout_s)
        keys = {r: KEY.format(rank=r) for r in range(1, self.me.world)}
        now = time.monotonic()
        self.seen = {r: (-1, now) for r in keys}  # the load counts as a sign of life
        period = beat_period(self.timeout_s)

        def run() -> None:
            while not self.done.is_set():
                try:
                    counts = {r: store.add(k, 0) for r, k in keys.items()}
                except Exception:  # noqa: BLE001 - the store is gone: the collectives name the fault
                    return
                self.record(counts, time.monotonic())
                self.done.wait(period)

        threading.Thread(target=run, name="moekit-watch", daemon=True).start()
        return self

    def record(self, counts: dict, now: float) -> None:
        with self.lock:
            for r, n in counts.items():
                if n != self.seen[r][0]:
                    self.seen[r] = (n, now)

    def silent(self, now: Optional[float] = None) -> dict:
        """rank → seconds since its counter last moved, for every follower."""
        now = time.monotonic() if now is None else now
        with self.lock:
            return {r: now - at for r, (_, at) in self.seen.items()}

    def stop(self) -> None:
        self.done.set()


def first_silent(silent: dict, at_least_s: float) -> Optional[int]:
    """The rank silent longest, if it has been silent `at_least_s`; None otherwise."""
    if not silent:
        return None
    rank = max(silent, key=lambda r: (silent[r], -r))
    return rank if silent[rank] >= at_least_s else None
