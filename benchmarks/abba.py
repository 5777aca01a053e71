"""Four engines placed A B B A, timed in alternating rounds: what benchmarks/compiled_step_ab.py and
huge_pages_ab.py share. The VM's speed drifts by ~20% within an hour and the first engine loaded
tends to time differently from the later ones; the placement and the alternation cancel both."""

from __future__ import annotations

import statistics
import time
from typing import Callable

PLACEMENT = ("a", "b", "b", "a")


def abba_ms(step_ms: Callable[[int], float], rounds: int) -> tuple[float, float]:
    """(A's, B's) ms a step: the geometric mean of each side's two engines' medians; step_ms(i)
    runs engine i (of PLACEMENT) once and returns its ms a step."""
    for i in range(4):  # untimed: a size the timed steps meet first may still compile once
        step_ms(i)
    times: list[list[float]] = [[] for _ in PLACEMENT]
    for r in range(rounds):
        for i in range(4) if r % 2 == 0 else reversed(range(4)):
            times[i].append(step_ms(i))
    med = [statistics.median(t) for t in times]
    return (med[0] * med[3]) ** 0.5, (med[1] * med[2]) ** 0.5


def timed_ms(run: Callable[[], object], steps: int) -> float:
    """ms a step of `run`, which decodes `steps` steps."""
    began = time.perf_counter()
    run()
    return (time.perf_counter() - began) / steps * 1e3
