"""A routing trace as arrays: one entry per token × MoE layer, each token's distinct experts.

Reads the Parquet trace of moekit.engine.trace (step, row, position, layer, expert_ids, weights;
an optional string column `domain` labels each entry's prompt) and checks it against the model
facts in its metadata. A token narrower than its forward's widest (per-token K, routing policies)
repeats its first expert at weight 0: only the first occurrence of an id counts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from moekit.engine.trace import TraceModel, read_trace_model
from moekit.errors import MoekitError

NEEDED = ("step", "row", "position", "layer", "expert_ids", "weights")
UNLABELLED = "unlabelled"


@dataclass(frozen=True)
class RoutingTrace:
    step: np.ndarray  # [N] int64
    row: np.ndarray  # [N] int64
    position: np.ndarray  # [N] int64
    layer: np.ndarray  # [N] int64
    ids: np.ndarray  # [N, K] int64 distinct experts in router order, -1 pads
    weights: np.ndarray  # [N, K] float64, 0 at pads
    domain: np.ndarray  # [N] object (str)
    experts: dict[int, int]  # MoE layer -> E
    model: Optional[TraceModel]
    table: object  # the pyarrow table, for the cache simulator
    notes: tuple[str, ...] = ()

    @property
    def layers(self) -> list[int]:
        return sorted(int(l) for l in np.unique(self.layer))

    @property
    def domains(self) -> list[str]:
        return sorted(set(self.domain.tolist()))

    def width(self) -> np.ndarray:
        """[N] distinct experts of each entry."""
        return (self.ids >= 0).sum(axis=1)

    def onehot(self, layer: int, mask: Optional[np.ndarray] = None) -> np.ndarray:
        """[n, E] bool: which experts each entry of `layer` (and `mask`) chose."""
        sel = self.layer == layer if mask is None else (self.layer == layer) & mask
        ids = self.ids[sel]
        out = np.zeros((len(ids), self.experts[layer]), dtype=bool)
        r, c = np.nonzero(ids >= 0)
        out[r, ids[r, c]] = True
        return out


def read_routing_trace(path: str | Path, num_experts: Optional[int] = None) -> RoutingTrace:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise MoekitError(f"{path}: no such trace file (write one with `moekit run ... --trace t.parquet`)")
    try:
        names = pq.read_schema(path).names
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise MoekitError(f"{path}: not a Parquet trace ({str(err).splitlines()[0]})") from None
    missing = [c for c in NEEDED if c not in names]
    if missing:
        raise MoekitError(f"{path}: not a routing trace, missing column(s) {', '.join(missing)}")
    return from_table(table, str(path), num_experts)


def _padded(column, name: str, dtype) -> np.ndarray:
    """A list column -> [N, Kmax] array, padded with -1."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = column.combine_chunks()
    if not pa.types.is_list(arr.type) and not pa.types.is_large_list(arr.type):
        raise TypeError(f"{name} is not a list column")
    flat = arr.flatten()
    if flat.null_count:
        raise TypeError(f"{name} holds nulls")
    parent = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
    lengths = np.bincount(parent, minlength=len(arr))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    slot = np.arange(len(parent)) - starts[parent]
    out = np.full((len(arr), max(int(lengths.max(initial=0)), 1)), -1, dtype=dtype)
    out[parent, slot] = flat.to_numpy(zero_copy_only=False).astype(dtype)
    return out


def _distinct(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Later repeats of an id in a row become pads (-1, weight 0)."""
    ids, weights = ids.copy(), weights.copy()
    for j in range(1, ids.shape[1]):
        repeat = (ids[:, :j] == ids[:, j : j + 1]).any(axis=1) & (ids[:, j] >= 0)
        ids[repeat, j] = -1
        weights[repeat, j] = 0.0
    weights[ids < 0] = 0.0
    return ids, weights


def from_table(table, name: str = "trace", num_experts: Optional[int] = None) -> RoutingTrace:
    import pyarrow as pa

    if table.num_rows == 0:
        raise MoekitError(f"{name}: the trace has no rows")
    try:
        ints = {c: table[c].to_numpy().astype(np.int64) for c in ("step", "row", "position", "layer")}
        ids = _padded(table["expert_ids"], "expert_ids", np.int64)
        weights = np.maximum(_padded(table["weights"], "weights", np.float64), 0.0)
    except (TypeError, ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise MoekitError(f"{name}: unreadable trace columns ({err})") from None
    if ids.shape != weights.shape:
        raise MoekitError(f"{name}: expert_ids and weights differ in length")
    if (ids >= 0).sum() == 0:
        raise MoekitError(f"{name}: the trace routes no token to any expert")
    if min(int(v.min()) for v in ints.values()) < 0 or int(ids.min()) < -1:
        raise MoekitError(f"{name}: negative step, row, position, layer or expert id in the trace")
    ids, weights = _distinct(ids, weights)
    model = read_trace_model(table.schema.metadata, name)
    experts, notes = _experts(ints["layer"], ids, model, num_experts, name)
    domain = np.full(table.num_rows, UNLABELLED, dtype=object)
    if "domain" in table.column_names:
        labels = table["domain"].to_pylist()
        domain = np.array([UNLABELLED if d is None else str(d) for d in labels], dtype=object)
    return RoutingTrace(ints["step"], ints["row"], ints["position"], ints["layer"], ids, weights, domain, experts,
                        model, table, tuple(notes))


def _experts(layer: np.ndarray, ids: np.ndarray, model: Optional[TraceModel], num_experts: Optional[int], name: str):
    """Experts per MoE layer: the trace's metadata, else --num-experts, else the highest id + 1 (noted)."""
    layers = sorted(int(l) for l in np.unique(layer))
    highest = {l: int(ids[layer == l].max()) for l in layers}
    notes = []
    if model is not None:
        unknown = [l for l in layers if l not in model.experts]
        if unknown:
            raise MoekitError(f"{name}: layer(s) {', '.join(map(str, unknown))} are not MoE layers of {model.name} "
                              f"(its MoE layers: {', '.join(map(str, sorted(model.experts)))})")
        experts = {l: model.experts[l] for l in layers}
    elif num_experts is not None:
        experts = {l: num_experts for l in layers}
    else:
        experts = {l: max(highest.values()) + 1 for l in layers}
        notes.append(f"the trace does not record the model's experts per layer; assumed {experts[layers[0]]} "
                     f"(the highest id seen + 1): give --num-experts E to be exact")
    for l in layers:
        if highest[l] >= experts[l]:
            who = model.name if model is not None else f"--num-experts {num_experts}"
            raise MoekitError(f"{name}: layer {l} routes to expert {highest[l]}, but {who} has {experts[l]} "
                              f"experts per layer: the trace comes from another model")
    return experts, notes
