"""Which kernel runs each kind of weight here: which build (AVX-512 or AVX2), rows grouped or not,
a bf16 batch widened to fp32 or not, and per shape whether the q8_0 / MXFP4 / FP8 operator beats
the reference. Each choice is measured once per machine, build and thread count, and persisted as
JSON beside the builds (`choices_path`), so that every later process takes the same path: kernels
that sum in different orders give different floats, and a choice made by timing in each process
let the same command take different paths in two processes.

What is fastest is the machine's: on an Intel Xeon the groups took a bf16 step's products 12% faster
and AVX-512 beat AVX2; on an AMD EPYC (Zen 4) the groups were 1.7x slower and AVX2 streamed ~20%
faster. Where the operators are not registered (`--kernels reference`, a failed build) every choice
is the default and nothing is measured.
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from moekit.ops import build as builds
from moekit.ops.runtime import available, namespaces, op
from moekit.ops.torch_private import cpu_has_avx512_bf16

KINDS = ("float32", "bfloat16", "q8_0")
PROBE_BYTES = 128 << 20  # past the last-level cache of the machines measured (32 MB on the AMD EPYC)
PROBE_EXPERTS, PROBE_CHOSEN = 32, 4  # a stack's experts, and those one row's call reads
BF16_MARGIN = 0.2  # past the probe's spread between processes for bf16 here (up to 16%, measured)
# fp32 keeps the native build unless another beats it by this much: on the Intel Xeon (AMX) the
# AVX-512 build's compiled fp32 step took 0.90x the AVX2 build's time at batch 1 and 0.91x at batch
# 16 (docs/BENCHMARKS.md), yet the probe, timed at load ~10, chose AVX2 there; on the AMD EPYC (Zen
# 4) AVX2 streamed fp32 ~20% faster and the probe chose it in 10 of 10 processes, past this margin.
# q8_0 the same (NATIVE_MARGIN_KINDS): on the Xeon the probe timed at load ~5 chose AVX2, and the idle
# re-timing chose AVX-512, whose step then decoded int8 at 1.26x llama.cpp (docs/BENCHMARKS.md).
FLOAT32_MARGIN = 0.1
NATIVE_MARGIN_KINDS = ("float32", "q8_0")
BATCH_PROBE_ROWS = 8  # the batch the targets name
WIDEN_MARGIN = 0.1  # a batch's bf16 products are widened only where that is clearly faster


@dataclass(frozen=True)
class Choice:
    """Which build of the operators (a torch.ops namespace) runs one kind of weight, and whether its
    one-row products take the weight rows in groups."""

    namespace: str = "moekit"
    grouped: bool = False

    @property
    def label(self) -> str:
        return self.namespace + (", grouped" if self.grouped else "")


def kind_of(weight: torch.Tensor) -> str:
    """The operators' name for a weight's kind: its dtype, or "q8_0" for the uint8 blocks."""
    return "q8_0" if weight.dtype == torch.uint8 else str(weight.dtype).removeprefix("torch.")


def choices_path(cache: Path = builds.DEFAULT_CACHE) -> Path:
    """The JSON file of the choices measured for this machine's native build (beside its folder)."""
    return builds.build_dir(builds.NATIVE, cache).parent / "choices.json"


def read_choices(cache: Path = builds.DEFAULT_CACHE) -> dict:
    """The persisted choices (empty where none were measured yet, or the file is unreadable)."""
    try:
        return json.loads(choices_path(cache).read_text())
    except (OSError, ValueError):
        return {}


LOADS = "load average when measured"  # the choices file's one key that is not a choice: key → load


def remembered(key: str, measure: Callable[[], Any], cache: Path = builds.DEFAULT_CACHE) -> Any:
    """The persisted value of key, or measure() persisted under it. One process measures at a time
    (a lock file beside the choices): two processes that measured at once could each keep their own
    answer, run different kernels and sum in different orders, so the second waits and reads the
    first's. The file is replaced atomically, the other keys kept. The machine's load average when
    the measuring began is kept beside (LOADS): a choice timed on a busy machine can be the wrong
    one on an idle one (busy_choices, `moekit ops build --remeasure`)."""
    known = read_choices(cache)
    if key in known:
        return known[key]
    path = choices_path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        known = read_choices(cache)
        if key in known:  # measured by another process while this one waited
            return known[key]
        load = round(os.getloadavg()[0], 2)
        value = measure()
        known = read_choices(cache)  # with what a measure that asked for another choice persisted
        loads = {**known.get(LOADS, {}), key: load}
        _write(path, {**known, key: value, LOADS: loads})
    return value


class _Held(threading.local):
    """The choices locks this thread holds. A measure may ask for another choice while its own is
    locked (int8's choose_gemv times the q8 operator, which asks for variant("q8_0")), and flock
    on a second open of the lock file waits even in the process that holds it: the process hung
    for good, with every process on the machine that measured anything waiting behind it."""

    def __init__(self):
        self.paths: set[Path] = set()


_HELD = _Held()


@contextmanager
def _locked(path: Path):
    """An exclusive lock beside the choices file, held while the context is open (a thread that
    holds it already just goes on: _Held)."""
    if path in _HELD.paths:
        yield
        return
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _HELD.paths.add(path)
        try:
            yield
        finally:
            _HELD.paths.discard(path)


def _write(path: Path, data: dict) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(f.name, path)


def busy(load: float, cpus: int) -> bool:
    """Whether a load average means other work shared the cores: more runnable threads than this
    machine has cores, before the measuring process's own."""
    return load > cpus


def busy_choices(cache: Path = builds.DEFAULT_CACHE, cpus: int | None = None) -> dict[str, float]:
    """key → load average of the choices that were measured while the machine was busy."""
    cpus = cpus or os.cpu_count() or 1
    return {k: v for k, v in read_choices(cache).get(LOADS, {}).items() if busy(v, cpus)}


def forget_choices(cache: Path = builds.DEFAULT_CACHE) -> int:
    """Remove every persisted choice (under the lock), so that the next use measures each again;
    how many there were. Later processes then take the new choices: kernels that sum in another
    order give other floats, so a saved compiled graph records the choices it was traced with and
    is not reused across a change (moekit.model.saved_graphs)."""
    path = choices_path(cache)
    if not path.exists():
        return 0
    with _locked(path):
        count = len([k for k in read_choices(cache) if k != LOADS])
        path.unlink(missing_ok=True)
    return count


def _key(what: str) -> str:
    return f"{what} threads={torch.get_num_threads()}"


@lru_cache(maxsize=None)
def variant(kind: str) -> Choice:
    """The fastest Choice here for one-row products on this kind of weight (KINDS): each build
    (`namespaces()`), rows grouped or not, timed on what a decode step does most: one row's 4 chosen
    experts of 32 read from distinct stacks of this kind (_probe, PROBE_BYTES in all, so from memory),
    7 alternating rounds after one to warm up, at the current thread count. The variants differ only
    in the order a row's vector lanes are summed (AVX2 8 lanes, AVX-512 16). The default Choice where
    the operators are not registered or the kind is not theirs.
    Why experts, not one large weight: on the AMD EPYC (Zen 4) a single 128 MB weight had the two
    builds within noise, while inside a compiled step the AVX-512 build's bf16 step was 11% faster
    and its fp32 step 22-28% slower; with the experts probe fp32 took the AVX2 build in 10 of 10
    processes, as the step wants; bf16 still swung. So for bf16 the build that multiplies bf16 pairs
    (AVX512-BF16, the default build on such a CPU) is kept unless another beats it by BF16_MARGIN,
    and for fp32 and q8_0 the native build unless another beats it by FLOAT32_MARGIN (`pick`)."""
    spaces = namespaces()
    if not spaces or kind not in KINDS:
        return Choice()
    saved = remembered(_key(f"variant {kind} {','.join(spaces)}"), lambda: _measure_variant(kind, spaces).__dict__)
    return Choice(**saved)


def _measure_variant(kind: str, spaces: tuple[str, ...]) -> Choice:
    x, stacks, chosen = _probe(kind)
    candidates = [Choice(space, way) for space in spaces for way in (False, True)]
    name = "experts_q8" if kind == "q8_0" else "experts_gemv"

    def run(v: Choice) -> None:
        product = op(v.namespace, name)
        for stack in stacks:
            for ids in chosen:
                product(x, stack, ids, v.grouped)

    median = alternating_medians({v: (lambda v=v: run(v)) for v in candidates}, rounds=8)
    return pick(kind, median, cpu_has_avx512_bf16())


def pick(kind: str, median: dict[Choice, float], multiplies_bf16: bool) -> Choice:
    """The Choice that the probe's medians (Choice → seconds) make for this kind: the fastest, except
    that bf16 keeps the default Choice() where the CPU multiplies bf16 pairs (multiplies_bf16) and
    fp32 and q8_0 the native build (its faster way), unless another beats it by BF16_MARGIN / FLOAT32_MARGIN."""
    best = min(median, key=median.get)
    if kind == "bfloat16" and multiplies_bf16 and median[best] * (1 + BF16_MARGIN) > median[Choice()]:
        return Choice()
    native = [c for c in median if c.namespace == Choice().namespace]
    if kind in NATIVE_MARGIN_KINDS and native:
        fastest_native = min(native, key=median.get)
        if median[best] * (1 + FLOAT32_MARGIN) > median[fastest_native]:
            return fastest_native
    return best


@lru_cache(maxsize=None)
def widen_batch(kind: str) -> bool:
    """Whether a batch's products on bf16 weights run faster here with the batch's rows widened to
    fp32 (fp32 FMAs on the widened weight) than as bf16 pairs (AVX512-BF16): both timed with the
    chosen build's rows_gemv on BATCH_PROBE_ROWS rows against distinct [2048, 512] bf16 weights,
    PROBE_BYTES in all (from memory), alternating; widening must win by WIDEN_MARGIN. Measured on an
    Intel Xeon (2 threads, 64 MB of weights, 8 rows): 4.0 ms widened against 7.2 ms in pairs.
    False for other kinds, or where the operators are not registered."""
    if kind != "bfloat16" or not namespaces():
        return False
    space = variant(kind).namespace
    return bool(remembered(_key(f"widen {kind} {space}"), lambda: _measure_widen(space)))


def _measure_widen(space: str) -> bool:
    width = 512
    weights = _distinct(torch.full((4 * width, width), 0.01, dtype=torch.bfloat16))
    rows = op(space, "rows_gemv")

    def run(x: torch.Tensor) -> None:
        for w in weights:
            rows(x, w, False)

    pairs, widened = torch.full((BATCH_PROBE_ROWS, width), 0.5, dtype=torch.bfloat16), torch.full((BATCH_PROBE_ROWS, width), 0.5)
    median = alternating_medians({"pairs": lambda: run(pairs), "widened": lambda: run(widened)}, rounds=6)
    return median["widened"] * (1 + WIDEN_MARGIN) < median["pairs"]


def bf16_tiles() -> bool:
    """Whether a batch's bf16 rows times bf16 weights run on AMX tiles in the build variant("bfloat16")
    chose (an AVX-512 build whose compiler and CPU have AMX-BF16, and a kernel that grants the tiles)."""
    return bool(namespaces()) and bool(op(variant("bfloat16").namespace, "bf16_tiles")())


def tiles_ready() -> bool:
    """Whether bf16 weights should be laid out in tiles here: the native build is registered and its
    batch products run on AMX tiles. The tiles operators are always that build's."""
    return "moekit" in namespaces() and bool(op("moekit", "bf16_tiles")())


def operator_wins(what: str, in_features: int, out_features: int, dtype: torch.dtype, timing: Callable[[], tuple[float, float]]) -> bool:
    """Whether the operator for `what` ("q8_0", "mxfp4", "fp8-128") runs one row of this shape faster
    than the reference here: timing() → (operator seconds, reference seconds), called once per
    machine, build and thread count (then persisted; the callers keep it per process). False where the operators are not registered."""
    if not available():
        return False
    key = _key(f"shape {what} {in_features}x{out_features} {str(dtype).removeprefix('torch.')}")
    return bool(remembered(key, lambda: (lambda t: t[0] < t[1])(timing())))


def chosen() -> dict[str, str]:
    """kind → the Choice for it in this process, in words (a benchmark's record of which build ran:
    the choice moved a step's time by 11-28%, measured). Empty where the operators are not registered."""
    if not available():
        return {}
    return {kind: variant(kind).label + (", batch widened to fp32" if widen_batch(kind) else "")
            + (", batch on AMX tiles" if kind == "bfloat16" and not widen_batch(kind) and bf16_tiles() else "") for kind in KINDS}


def mean_time(fn, *args, repeats: int = 10) -> float:
    """Seconds per call of fn(*args), after one untimed call (kernel choice at load)."""
    fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats


def alternating_medians(sides: dict, rounds: int) -> dict:
    """name → the median seconds of its call over `rounds` rounds, the sides taking turns (a noisy
    neighbour slows all alike), the first round a warm-up left out."""
    times: dict = {name: [] for name in sides}
    for _ in range(rounds):
        for name, call in sides.items():
            began = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def _distinct(t: torch.Tensor) -> list[torch.Tensor]:
    """t and copies of it, PROBE_BYTES in all: a probe that reads them all reads from memory."""
    return [t] + [t.clone() for _ in range(max(0, PROBE_BYTES // t.nbytes - 1))]


def _probe(kind: str, width: int = 512) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """x [1, 1, width]; distinct expert stacks [PROBE_EXPERTS, width, width] of this kind, PROBE_BYTES
    in all; and the experts the calls choose ([1, PROBE_CHOSEN] each), which read every expert of a
    stack once. Constant values: their speed is any values'."""
    if kind == "q8_0":
        from moekit.ops.q8_0 import quantize_q8_0

        row = quantize_q8_0(torch.full((1, width), 0.01))  # [1, nb * 34]
        stack = row.expand(PROBE_EXPERTS * width, -1).reshape(PROBE_EXPERTS, width, -1).contiguous()
        x = torch.full((1, 1, width), 0.5)
    else:
        dtype = getattr(torch, kind)
        stack = torch.full((PROBE_EXPERTS, width, width), 0.01, dtype=dtype)
        x = torch.full((1, 1, width), 0.5, dtype=dtype)
    stacks = _distinct(stack)
    chosen = [torch.arange(first, first + PROBE_CHOSEN)[None] for first in range(0, PROBE_EXPERTS, PROBE_CHOSEN)]
    return x, stacks, chosen
