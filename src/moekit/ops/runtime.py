"""Which of moekit's operators this process has: loading the machine's builds (building them first
where the cache has none), and asking whether an operator is registered.

The commands load the operators before a run (`--kernels auto`, the default) or never
(`--kernels reference`); the code that calls an operator only asks `available`, so what a run
computes depends on the command's choice, not on what the process happened to build before.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from moekit.ops import build as builds
from moekit.ops.fake import register_fakes

# Every operator by its plain name; a build's names end in its suffix (rows_gemv_avx2).
OPERATORS = ("rows_gemv", "experts_gemv", "rows_q8", "experts_q8", "rows_argmax", "transpose_into", "latent_attend", "attend",
             "rows_tiles", "experts_tiles", "bf16_tiles", "mxfp4_gemv", "fp8_gemv", "experts_mxfp4", "experts_fp8")
KERNELS = ("auto", "reference")  # the --kernels choices


@dataclass(frozen=True)
class Loaded:
    """The outcome of loading this machine's builds: each variant's BuildResult."""

    results: tuple[builds.BuildResult, ...]

    @property
    def ok(self) -> bool:
        """Whether the native build (the one every operator call can rely on) loaded."""
        return bool(self.results) and self.results[0].ok

    def failures(self) -> list[str]:
        """One line per build that failed, naming its log."""
        return [r.line() for r in self.results if not r.ok]


def operators_used(compile_step: bool, weights: str, dtype: str, paged: bool, packed: bool = False) -> bool:
    """Whether a run with these options uses the operators: the compiled step, int8 weights (any
    `--weights` but "dtype"), MXFP4 / FP8 experts kept packed, or fp32 / bf16 weights: the eager
    step's products (moekit.model.linear.ROWS), and at fp32 the expert store's misses (`paged`),
    which they lay out. Only an eager run at another dtype (fp16) never loads them."""
    return compile_step or weights != "dtype" or packed or dtype in ("float32", "bfloat16")


@lru_cache(maxsize=None)
def load(cache: Path = builds.DEFAULT_CACHE, extra_flags: tuple[str, ...] = ()) -> Loaded:
    """Build (where the cache has none) and register this machine's variants, once per process. A
    variant whose build fails is reported in Loaded, not raised; where the native build fails the
    AVX2 one is not tried (it would fail the same way)."""
    results = []
    for variant in builds.machine_variants():
        result = builds.build(variant, cache, extra_flags)
        results.append(result)
        if not result.ok:
            break
        register_fakes(variant.namespace, variant.suffix)
    return Loaded(tuple(results))


@lru_cache(maxsize=None)
def load_variant(variant: builds.Variant, cache: Path = builds.DEFAULT_CACHE) -> builds.BuildResult:
    """Build and register one variant alone (the tests' forced scalar build)."""
    result = builds.build(variant, cache)
    if result.ok:
        register_fakes(variant.namespace, variant.suffix)
    return result


def available(name: str = "rows_gemv", namespace: str = "moekit") -> bool:
    """Whether this process has the operator registered (its command loaded the operators). Read
    while Dynamo traces: a constant in the graph."""
    return hasattr(getattr(torch.ops, namespace), name + suffix(namespace))


def suffix(namespace: str) -> str:
    """What the operator names of one build end in: "" for moekit, "_avx2" for moekit_avx2."""
    return "" if namespace == "moekit" else "_" + namespace.removeprefix("moekit_")


def op(namespace: str, name: str):
    """One build's operator by its plain name: torch.ops.moekit.rows_gemv, torch.ops.moekit_avx2.rows_gemv_avx2."""
    return getattr(getattr(torch.ops, namespace), name + suffix(namespace))


def namespaces() -> tuple[str, ...]:
    """The machine's builds this process has registered (none where its command did not load them)."""
    return tuple(v.namespace for v in builds.machine_variants() if available("rows_gemv", v.namespace))
