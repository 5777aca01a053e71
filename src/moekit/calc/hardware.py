"""The hardware catalog: memory capacity, bandwidth and peak dense FLOPs per dtype of named
devices (data in hardware.json, each entry with its vendor source), plus `local`, this machine
measured by a short probe (see probe.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Callable

from moekit.errors import MoekitError

GIB = 1024**3
LOCAL = "local"

# When a part has no tensor rate for the compute dtype, the matmul runs at the next one down
# (fp8 weights on an A100 are upcast to bf16). fp32 is plain fp32, not tf32: PyTorch's default.
PEAK_FALLBACK = {
    "fp32": ("fp32",),
    "bf16": ("bf16", "fp16", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "fp8": ("fp8", "bf16", "fp16", "fp32"),
    "int8": ("int8", "bf16", "fp16", "fp32"),
}


@dataclass(frozen=True)
class Hardware:
    name: str
    label: str
    memory_bytes: int
    bandwidth: float  # bytes/s
    flops: tuple[tuple[str, float], ...]  # dtype → FLOP/s, dense
    source: str
    measured: bool = False

    def peak(self, compute: str) -> tuple[str, float]:
        """(dtype whose rate applies, FLOP/s) for matmuls in `compute`."""
        rates = dict(self.flops)
        for dtype in PEAK_FALLBACK[compute]:
            if dtype in rates:
                return dtype, rates[dtype]
        raise MoekitError(f"{self.name}: no peak FLOPs known for {compute}")


def _from_entry(entry: dict) -> Hardware:
    return Hardware(
        name=entry["name"],
        label=entry["label"],
        memory_bytes=int(entry["memory_gib"] * GIB),
        bandwidth=entry["bandwidth_gb_s"] * 1e9,
        flops=tuple((k, v * 1e12) for k, v in entry["tflops"].items()),
        source=entry["source"],
    )


def catalog_entries() -> list[dict]:
    text = resources.files("moekit.calc").joinpath("hardware.json").read_text()
    return json.loads(text)["devices"]


def catalog() -> dict[str, Hardware]:
    return {entry["name"]: _from_entry(entry) for entry in catalog_entries()}


def aliases() -> dict[str, str]:
    """Every accepted spelling → catalog name."""
    table = {}
    for entry in catalog_entries():
        table[entry["name"]] = entry["name"]
        for alias in entry["aliases"]:
            table[alias] = entry["name"]
    return table


def known_names() -> list[str]:
    return [*catalog(), LOCAL]


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def get_hardware(name: str, probe: Callable[[], Hardware] | None = None) -> Hardware:
    """A catalog device by name or alias, or `local` (measured now by `probe`)."""
    key = _normalise(name)
    if key == LOCAL:
        if probe is None:
            from moekit.calc.probe import probe_local

            probe = probe_local
        return probe()
    table = aliases()
    if key not in table:
        raise MoekitError(f"unknown hardware {name!r}; known: {', '.join(known_names())}")
    return catalog()[table[key]]
