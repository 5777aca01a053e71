"""Stand-ins for paged experts (HOBBIT's substitution on a cache miss): every routed expert also
held resident as int4 (q4_0), run in place of a missed expert while its full copy is read behind.

Each expert is read once at start (checksummed as any first load), quantized to q4_0 from the
engine's dtype, and kept: 18 bytes per 32 weights (0.28 of bf16's bytes, 0.14 of fp32's). A
forward that misses an expert runs its stand-in and the full copy loads on a worker; the next
forward that needs the expert waits for it only if it is still loading and no stand-in exists.
"""

from __future__ import annotations

from moekit.errors import MoekitError
from moekit.model.experts import StandIn
from moekit.model.linear import INT4

SUBSTITUTES = ("int4",)


def parse_substitute(text: str) -> str:
    if text.strip().lower() not in SUBSTITUTES:
        raise MoekitError(f"--substitute {text!r}: the forms are {', '.join(SUBSTITUTES)}")
    return text.strip().lower()


def stand_ins(reader, kinds: dict, layer: int, num_experts: int, verify: bool) -> list[StandIn]:
    """Layer's experts as int4 StandIns, read through `reader` (moekit.offload.reader.ExpertReader)."""
    out = []
    for e in range(num_experts):
        if kinds[layer, e] is not None:
            raise MoekitError(f"--substitute int4 needs float experts; layer {layer} expert {e} is stored as "
                              f"{kinds[layer, e]}")
        gate_up, down = reader.read(layer, e, verify=verify)
        out.append(StandIn(INT4.prepare(gate_up), INT4.prepare(down), (INT4, INT4)))
    return out


def stand_in_bytes(ins: list[StandIn]) -> int:
    return sum(w.gate_up.numel() * w.gate_up.element_size() + w.down.numel() * w.down.element_size() for w in ins)
