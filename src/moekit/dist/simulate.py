"""The cluster simulator: replay a routing trace through a placement at R ranks, without the model.

Per MoE layer forward it builds the [R, R] pair matrix the runtime's exchange would move
(exchange.traffic: home chunks, round-robin replicas) and derives from it:
  tokens per rank    the pairs each rank's experts compute; balancedness = mean ÷ max (vLLM's figure)
  bytes              dispatch (hidden rows to the experts' ranks) + combine (outputs back), rows of
                     D values at the engine dtype, split intra-node (same node of 8) / inter-node;
                     pairs a rank keeps for itself cross no link and are not counted
  step time          per layer: the slowest rank's dispatch + expert compute + combine; expert
                     compute = max(weights of its touched experts ÷ HBM bandwidth, 2·pairs·expert
                     params ÷ peak FLOP/s), the links' time = the busiest rank's bytes ÷ link
                     bandwidth (links.json: NVLink within a node, the NIC between nodes). Bandwidth
                     only: no latency, no overlap, no attention; a lower bound for large batches
  memory             routed-expert weights on the fullest rank, copies included (no capacity check)
A forward of a trace is one (step, layer): the prompt of every row at step 0, one token per row
after, tokens ordered by row then position as the engine flattens them. The live run also moves
left-padding positions of a batched prefill, which a trace leaves out: agreement with the runtime
is exact for a single prompt (tests/dist).

No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional

import numpy as np

from moekit.dist.exchange import traffic
from moekit.dist.placement import Placement, RouteTable
from moekit.errors import MoekitError

TRACE_COLUMNS = ("step", "row", "position", "layer", "expert_ids")


@dataclass(frozen=True)
class Forwards:
    """A trace as the MoE forwards the engine ran: per layer, one topk_ids [T, K] per forward."""

    layers: dict[int, list[np.ndarray]]
    experts: dict[int, int]  # MoE layer → E
    model: dict = field(default_factory=dict)  # name, model_type, config_sha256 (when the trace says)
    trace_model: Optional[object] = None  # the moekit.engine.trace.TraceModel of its metadata, if any

    @property
    def tokens(self) -> int:
        """Tokens routed per layer over the whole trace."""
        first = next(iter(self.layers.values()))
        return sum(len(ids) for ids in first)


def read_forwards(path: str | Path) -> Forwards:
    """A `moekit run --trace` Parquet file → its forwards (numpy grouping: 100k rows in milliseconds)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moekit.engine.trace import read_trace_model

    path = Path(path)
    if not path.is_file():
        raise MoekitError(f"{path}: no such trace file (write one with `moekit run ... --trace t.parquet`)")
    try:
        table = pq.read_table(path, columns=list(TRACE_COLUMNS))
    except (pa.ArrowInvalid, OSError, KeyError) as err:
        raise MoekitError(f"{path}: not a routing trace ({str(err).splitlines()[0]})") from None
    if table.num_rows == 0:
        raise MoekitError(f"{path}: the trace has no rows")
    model = read_trace_model(table.schema.metadata, str(path))
    cols = {c: table[c].to_numpy() for c in ("step", "row", "position", "layer")}
    lists = table["expert_ids"].to_pylist()
    width = max(len(ids) for ids in lists)
    # A narrower row (a lower expert-budget tier) repeats its first expert, as the router does.
    ids = np.array([list(r) + [r[0]] * (width - len(r)) for r in lists], dtype=np.int64)  # [rows, K]
    order = np.lexsort((cols["position"], cols["row"], cols["step"], cols["layer"]))
    layers: dict[int, list[np.ndarray]] = {}
    key = cols["layer"][order].astype(np.int64) * (int(cols["step"].max()) + 1) + cols["step"][order]
    cuts = np.flatnonzero(np.diff(key)) + 1
    for chunk in np.split(order, cuts):
        layers.setdefault(int(cols["layer"][chunk[0]]), []).append(ids[chunk])
    if model is not None:
        experts = {l: model.experts[l] for l in layers if l in model.experts}
        if set(experts) != set(layers):
            raise MoekitError(f"{path}: the trace routes layers that are not MoE layers of {model.name}")
        facts = {"model": model.name, "model_type": model.model_type, "config_sha256": model.config_sha256}
    else:
        top = int(ids.max()) + 1
        experts, facts = {l: top for l in layers}, {}
    for l, fwd in layers.items():
        if max(int(f.max()) for f in fwd) >= experts[l]:
            raise MoekitError(f"{path}: layer {l} routes to an expert id beyond its {experts[l]} experts")
    return Forwards(layers=layers, experts=experts, model=facts, trace_model=model)


def uniform_forwards(experts: dict[int, int], top_k: int, tokens: int, forwards: int, seed: int = 0) -> Forwards:
    """A synthetic trace: every token picks K distinct experts uniformly at random (a perfectly
    balanced router in expectation: what remains is the imbalance of chance)."""
    rng = np.random.default_rng(seed)
    layers = {}
    for l, e in experts.items():
        layers[l] = [np.argsort(rng.random((tokens, e)), axis=1)[:, :top_k] for _ in range(forwards)]
    return Forwards(layers=layers, experts=dict(experts), model={"model": "uniform"})


@dataclass(frozen=True)
class Links:
    """Per-GPU, per-direction link bandwidths of a cluster built from one catalog device."""

    intra: float  # bytes/s, within a node (NVLink / Infinity Fabric)
    inter: float  # bytes/s, between nodes (the GPU's NIC)
    source: str


def links_for(hardware: str) -> Links:
    doc = json.loads(resources.files("moekit.dist").joinpath("links.json").read_text())["devices"]
    if hardware not in doc:
        raise MoekitError(f"no link bandwidths known for {hardware!r}; known: {', '.join(sorted(doc))}")
    entry = doc[hardware]
    return Links(intra=entry["intra_gb_s"] * 1e9, inter=entry["inter_gb_s"] * 1e9, source=entry["source"])


@dataclass(frozen=True)
class Cost:
    """What the step-time estimate needs besides the trace: one row's bytes, one expert's size."""

    row_bytes: int  # D × bytes per value at the engine dtype
    expert_bytes: int = 0  # one routed expert's weights
    expert_params: int = 0
    hbm: float = 0.0  # bytes/s
    flops: float = 0.0  # FLOP/s at the engine dtype
    links: Optional[Links] = None
    memory: float = 0.0  # bytes of device memory

    @property
    def timed(self) -> bool:
        return self.links is not None and self.hbm > 0


@dataclass
class LayerSim:
    pairs: np.ndarray  # [R] pairs each rank computed over the trace
    dispatch_bytes: np.ndarray  # [R] hidden rows each rank sent to other ranks
    combine_bytes: np.ndarray  # [R] outputs each rank sent back
    intra_bytes: int = 0  # dispatch + combine within nodes
    inter_bytes: int = 0  # ... between nodes
    time_s: float = 0.0  # Σ over forwards of the estimated layer time
    a2a_s: float = 0.0  # ... of which dispatch + combine

    @property
    def balancedness(self) -> float:
        return float(self.pairs.mean() / self.pairs.max()) if self.pairs.max() else 1.0


def _forward_time(matrix: np.ndarray, ids: np.ndarray, dest: np.ndarray, node: np.ndarray, cost: Cost,
                  ranks: int, experts: int) -> tuple[float, float]:
    """(layer time, all-to-all time) of one forward, the slowest rank bounding each phase."""
    same = node[:, None] == node[None, :]
    off = ~np.eye(ranks, dtype=bool)
    rows = matrix * cost.row_bytes
    intra, inter = np.where(same & off, rows, 0), np.where(~same, rows, 0)
    # Dispatch: rank h sends row h, receives column h; combine is the transpose.
    link = np.maximum(np.maximum(intra.sum(1), intra.sum(0)) / cost.links.intra,
                      np.maximum(inter.sum(1), inter.sum(0)) / cost.links.inter)
    a2a = 2 * float(link.max())
    touched = np.bincount(np.unique(dest * experts + ids) // experts, minlength=ranks)
    pairs = matrix.sum(0)
    compute = np.maximum(touched * cost.expert_bytes / cost.hbm, 2 * pairs * cost.expert_params / cost.flops)
    return a2a + float(compute.max()), a2a


def simulate(forwards: Forwards, placement: Placement, cost: Cost) -> dict[int, LayerSim]:
    ranks = placement.ranks
    node = np.arange(ranks) // placement.ranks_per_node
    same = node[:, None] == node[None, :]
    off = ~np.eye(ranks, dtype=bool)
    out = {}
    for l, fwds in forwards.layers.items():
        table = RouteTable.of(placement.layers[l])
        sim = LayerSim(np.zeros(ranks, np.int64), np.zeros(ranks, np.int64), np.zeros(ranks, np.int64))
        for f, ids in enumerate(fwds):
            matrix = traffic(ids, ranks, table, f)  # [R, R] pairs homed on h, computed on d
            moved = np.where(off, matrix, 0) * cost.row_bytes
            sim.pairs += matrix.sum(0)
            sim.dispatch_bytes += moved.sum(1)
            sim.combine_bytes += moved.sum(0)
            sim.intra_bytes += 2 * int(moved[same].sum())
            sim.inter_bytes += 2 * int(moved[~same].sum())
            if cost.timed:
                flat = ids.reshape(-1)
                dest = table.owners(flat, np.arange(len(flat)) // ids.shape[1], f)
                t, a2a = _forward_time(matrix, flat, dest, node, cost, ranks, placement.layers[l].num_experts)
                sim.time_s += t
                sim.a2a_s += a2a
        out[l] = sim
    return out


def sim_report(forwards: Forwards, placement: Placement, sims: dict[int, LayerSim], cost: Cost) -> dict:
    """The figures `moekit simulate` prints: overall and per layer."""
    tokens = forwards.tokens
    steps = len(next(iter(forwards.layers.values())))
    per_layer = {str(l): {"balancedness": s.balancedness, "pairs_per_rank_max": int(s.pairs.max()),
                          "pairs_per_rank_mean": float(s.pairs.mean())} for l, s in sims.items()}
    intra = sum(s.intra_bytes for s in sims.values())
    inter = sum(s.inter_bytes for s in sims.values())
    per_rank = max(sum(len(p.ranks[r]) for p in placement.layers.values()) for r in range(placement.ranks)) * cost.expert_bytes
    report = {
        "ranks": placement.ranks,
        "placement": placement.source,
        "redundant": placement.redundant,
        "tokens": tokens,
        "forwards_per_layer": steps,
        "balancedness": float(np.mean([s.balancedness for s in sims.values()])),
        "bytes_per_token": (intra + inter) / tokens,
        "intra_node_bytes_per_token": intra / tokens,
        "inter_node_bytes_per_token": inter / tokens,
        # Routed-expert weights on the fullest rank (copies included), against the device's memory.
        "expert_bytes_per_rank": per_rank,
        "device_memory_bytes": cost.memory or None,
        # A plan whose experts do not fit a rank runs at no speed: its time is an "if it fit" figure.
        "fits_memory": per_rank <= cost.memory if cost.memory else None,
        "moe_time_per_forward_s": sum(s.time_s for s in sims.values()) / steps if cost.timed else None,
        "a2a_time_per_forward_s": sum(s.a2a_s for s in sims.values()) / steps if cost.timed else None,
        "layers": per_layer,
    }
    return report
