"""What the user asked the calculator for, parsed and checked once: bad values become one-line
MoekitErrors naming the option, before any arithmetic runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from moekit.calc.dtypes import DType, default_kv_dtype, get_dtype, get_kv_dtype
from moekit.errors import MoekitError

DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class CalcRequest:
    dtype: DType
    kv_dtype: DType
    context: int  # tokens already in each sequence's cache when the next one is decoded
    batch: int  # sequences decoded together
    hardware: Optional[str] = None
    gpus: int = 1
    sla_ms: Optional[float] = None


def positive_int(option: str, text: object) -> int:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise MoekitError(f"{option} must be a positive integer, got {text!r}") from None
    if not math.isfinite(value) or value != int(value) or value < 1:
        raise MoekitError(f"{option} must be a positive integer, got {text!r}")
    return int(value)


def positive_float(option: str, text: object) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise MoekitError(f"{option} must be a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise MoekitError(f"{option} must be a positive number, got {text!r}")
    return value


def parse_request(
    dtype: str = "bf16",
    kv_dtype: Optional[str] = None,
    context: object = DEFAULT_CONTEXT,
    batch: object = 1,
    hardware: Optional[str] = None,
    gpus: object = 1,
    sla_ms: Optional[object] = None,
) -> CalcRequest:
    weights = get_dtype(dtype)
    n_gpus = positive_int("--gpus", gpus)
    budget = None if sla_ms is None else positive_float("--sla-ms", sla_ms)
    if hardware is None and budget is not None:
        raise MoekitError("--sla-ms needs --hardware (the budget is spent on some device)")
    if hardware is None and n_gpus != 1:
        raise MoekitError("--gpus needs --hardware (how many of which device?)")
    return CalcRequest(
        dtype=weights,
        kv_dtype=default_kv_dtype(weights) if kv_dtype is None else get_kv_dtype(kv_dtype),
        context=positive_int("--context", context),
        batch=positive_int("--batch", batch),
        hardware=hardware,
        gpus=n_gpus,
        sla_ms=budget,
    )
