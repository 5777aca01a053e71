"""Storage dtypes the calculator plans for: bits per weight, block scales included, and the
tensor-core dtype whose peak FLOPs bound the matmuls.

Conventions (also printed by `--explain`):
- fp8 and int8 ignore per-tensor / per-channel scales (a few bytes per matrix).
- int4 is GPTQ/AWQ-style: 4-bit values plus one fp16 scale per group of 128 = 4.125 bits.
- mxfp4 is the OCP microscaling format gpt-oss ships: 4-bit e2m1 values plus one 8-bit e8m0
  scale per block of 32 = 4.25 bits.
- 4-bit weights are dequantised to bf16 for the matmul, so bf16 peak FLOPs bound their compute.
- `--dtype` applies to every parameter. Real quantised checkpoints often keep embeddings, norms
  and routers in bf16; the difference is a few percent at most for large models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from moekit.errors import MoekitError


@dataclass(frozen=True)
class DType:
    name: str
    bits: Fraction  # storage bits per weight, block scales included
    compute: str  # peak-FLOPs key in the hardware catalog
    convention: str

    def bytes_for(self, params: int) -> int:
        """Bytes to store `params` weights, rounded up to whole bytes."""
        return math.ceil(params * self.bits / 8)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("fp32", Fraction(32), "fp32", "32 bits"),
        DType("bf16", Fraction(16), "bf16", "16 bits"),
        DType("fp16", Fraction(16), "fp16", "16 bits"),
        DType("fp8", Fraction(8), "fp8", "8 bits (e4m3; per-tensor scales ignored)"),
        DType("int8", Fraction(8), "int8", "8 bits (per-channel scales ignored)"),
        DType(
            "int4",
            Fraction(4) + Fraction(16, 128),
            "bf16",
            "4 bits + one fp16 scale per group of 128 = 4.125 bits; matmul in bf16",
        ),
        DType(
            "mxfp4",
            Fraction(4) + Fraction(8, 32),
            "bf16",
            "4 bits + one 8-bit scale per block of 32 = 4.25 bits; matmul in bf16",
        ),
    )
}

# A KV cache holds activations, not weights: block-quantised 4-bit formats do not apply.
KV_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")

ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def get_dtype(name: str) -> DType:
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in DTYPES:
        raise MoekitError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[key]


def get_kv_dtype(name: str) -> DType:
    dtype = get_dtype(name)
    if dtype.name not in KV_DTYPES:
        raise MoekitError(f"KV cache dtype {name!r} not supported; use one of {', '.join(KV_DTYPES)}")
    return dtype


def default_kv_dtype(weights: DType) -> DType:
    """Quantised weights rarely come with a quantised cache: the cache stays bf16 unless the
    weights are themselves a 16- or 32-bit float."""
    return weights if weights.name in ("fp32", "bf16", "fp16") else DTYPES["bf16"]
