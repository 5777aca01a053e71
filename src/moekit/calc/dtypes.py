"""Storage dtypes the calculator plans for: bits per weight, block scales included, and the
tensor-core dtype whose peak FLOPs bound the matmuls.

Conventions (also printed by `--explain`):
- fp8 and int8 ignore per-tensor / per-channel scales (a few bytes per matrix).
- int4 is GPTQ/AWQ-style: 4-bit values plus one fp16 scale per group of 128 = 4.125 bits.
- mxfp4 is the OCP microscaling format gpt-oss ships: 4-bit e2m1 values plus one 8-bit e8m0
  scale per block of 32 = 4.25 bits.
- 4-bit weights are dequantised to bf16 for the matmul, so bf16 peak FLOPs bound their compute.
- `--dtype` applies to every parameter, except mxfp4: it is an expert format (gpt-oss publishes
  MXFP4 routed experts and bf16 everything else), so its always-resident weights are priced at
  bf16. Other quantised checkpoints often keep embeddings, norms and routers in bf16 too; the
  difference is a few percent at most for large models.
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
    dense: str = ""  # the dtype of the always-resident weights when it differs (an expert-only format)

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
            "4 bits + one 8-bit scale per block of 32 = 4.25 bits, routed experts only (the rest bf16,"
            " as gpt-oss ships); matmul in bf16",
            dense="bf16",
        ),
    )
}

def dense_dtype(dtype: DType) -> DType:
    """The dtype the always-resident weights (attention, embeddings, routers, shared experts) are
    stored at under `dtype`: itself, unless it is an expert-only format."""
    return DTYPES[dtype.dense] if dtype.dense else dtype


# A KV cache holds activations, not weights: block-quantised 4-bit formats do not apply.
KV_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")

# The one dtype vocabulary of every command (run, serve, bench, profile, simulate, calc, pack): each
# name below means the dtype it maps to, whichever command reads it.
ALIASES = {"float32": "fp32", "f32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
           "f16": "fp16", "float8": "fp8", "fp8_e4m3": "fp8"}

# The names torch spells them with: the engine's `dtype` strings.
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# What the native engine runs at (--dtype of run, serve, bench, profile).
ENGINE_DTYPES = ("fp32", "bf16")


def canonical_dtype(name: str) -> str:
    """'bfloat16', ' BF16 ' → 'bf16': the vocabulary's own name of NAME (unchecked)."""
    key = str(name).strip().lower()
    return ALIASES.get(key, key)


def spellings(allowed) -> str:
    """'fp32 (float32) or bf16 (bfloat16)': the names a refusal offers, each with its long alias."""
    long_names = {short: long for long, short in ALIASES.items() if long in ("float32", "bfloat16", "float16", "float8")}
    names = [f"{d} ({long_names[d]})" if d in long_names else d for d in allowed]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def dtype_choice(name: str, allowed, option: str = "--dtype") -> str:
    """NAME, in any spelling of the vocabulary, as its canonical name, when it is one of ALLOWED."""
    key = canonical_dtype(name)
    if key not in allowed:
        raise MoekitError(f"{option} {name!r}: this command takes {spellings(allowed)}")
    return key


def engine_dtype(name: str, option: str = "--dtype") -> str:
    """--dtype of a command that runs the engine, as torch names it ('bf16' → 'bfloat16')."""
    return TORCH_NAMES[dtype_choice(name, ENGINE_DTYPES, option)]


def get_dtype(name: str) -> DType:
    key = canonical_dtype(name)
    if key not in DTYPES:
        raise MoekitError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)} (or float32, bfloat16, float16)")
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
