"""Which logical expert lives on which rank, per MoE layer, and which replica serves a token.

A placement lists, per MoE layer, the logical experts each rank holds (its physical experts). Every
logical expert is held at least once; a hot one may be held more often (a redundant replica). The
default is linear: rank r holds experts [r·E/R, (r+1)·E/R), so an E that R does not divide gives
ranks one expert more or less. `moekit placement` writes plans as JSON (PLACEMENT_FORMAT):

    {"format": "moekit-placement", "version": 1, "model": ..., "model_type": ..., "config_sha256": ...,
     "ranks": R, "ranks_per_node": 8, "redundant": N,
     "layers": {"3": {"num_experts": E, "ranks": [[ids on rank 0], [ids on rank 1], ...]}, ...}}

A token's replica is chosen by round robin: replica (forward + token) mod count, where `forward`
counts the layer's forwards and `token` is the token's index in the forward. The runtime and the
simulator both call `RouteTable.owners`, so they agree on every pair's rank.

No torch here: the planner and the simulator run on a laptop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from moekit.errors import MoekitError

PLACEMENT_FORMAT = "moekit-placement"
PLACEMENT_VERSION = 1
RANKS_PER_NODE = 8  # GPUs per node of the clusters the planner and simulator model (DGX/HGX)


@dataclass(frozen=True)
class LayerPlacement:
    num_experts: int
    ranks: tuple[tuple[int, ...], ...]  # ranks[r]: the logical experts rank r holds

    def replicas(self) -> list[list[int]]:
        """replicas[e]: the ranks holding logical expert e, one entry per physical copy, ascending."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for r, ids in enumerate(self.ranks):
            for e in ids:
                out[e].append(r)
        return out

    def local(self, rank: int) -> tuple[int, ...]:
        """The distinct logical experts `rank` holds, ascending."""
        return tuple(sorted(set(self.ranks[rank])))


@dataclass(frozen=True)
class RouteTable:
    """A layer's replicas as arrays: table[e, j] is the rank of e's j-th copy, count[e] the copies."""

    table: np.ndarray  # [E, max copies] int64
    count: np.ndarray  # [E] int64

    @classmethod
    def of(cls, layer: LayerPlacement) -> "RouteTable":
        replicas = layer.replicas()
        width = max(len(r) for r in replicas)
        table = np.zeros((layer.num_experts, width), dtype=np.int64)
        for e, ranks in enumerate(replicas):
            table[e, : len(ranks)] = ranks
        return cls(table=table, count=np.array([len(r) for r in replicas], dtype=np.int64))

    def owners(self, experts: np.ndarray, tokens: np.ndarray, forward: int) -> np.ndarray:
        """The rank that computes each (token, expert) pair: experts [N] logical ids, tokens [N] the
        pairs' token indices in the forward → [N] ranks (round robin over the expert's copies)."""
        pick = (forward + tokens) % self.count[experts]
        return self.table[experts, pick]


@dataclass(frozen=True)
class Placement:
    ranks: int
    layers: dict[int, LayerPlacement]  # MoE layer index → its placement
    ranks_per_node: int = RANKS_PER_NODE
    redundant: int = 0  # physical experts per layer beyond one per logical expert
    model: dict = field(default_factory=dict)  # name, model_type, config_sha256 of the model planned for
    source: str = "linear"  # "linear", or the file it was read from

    def tables(self) -> dict[int, RouteTable]:
        return {l: RouteTable.of(p) for l, p in self.layers.items()}

    def to_json(self, extra: Optional[dict] = None) -> dict:
        doc = {
            "format": PLACEMENT_FORMAT,
            "version": PLACEMENT_VERSION,
            **{k: self.model.get(k) for k in ("model", "model_type", "config_sha256")},
            "ranks": self.ranks,
            "ranks_per_node": self.ranks_per_node,
            "redundant": self.redundant,
            "layers": {str(l): {"num_experts": p.num_experts, "ranks": [list(r) for r in p.ranks]}
                       for l, p in sorted(self.layers.items())},
        }
        doc.update(extra or {})
        return doc


def linear_ranks(num_experts: int, ranks: int) -> tuple[tuple[int, ...], ...]:
    """Rank r holds experts [r·E/R, (r+1)·E/R): contiguous, one more or less where R does not divide E."""
    bounds = [r * num_experts // ranks for r in range(ranks + 1)]
    return tuple(tuple(range(bounds[r], bounds[r + 1])) for r in range(ranks))


def linear_placement(experts: dict[int, int], ranks: int, model: Optional[dict] = None,
                     ranks_per_node: int = RANKS_PER_NODE) -> Placement:
    """experts: MoE layer → E. Refuses more ranks than experts (a rank would hold none)."""
    if ranks < 1:
        raise MoekitError(f"the rank count must be at least 1, got {ranks}")
    fewest = min(experts.values())
    if ranks > fewest:
        raise MoekitError(f"{ranks} ranks but only {fewest} routed experts per layer: every rank must hold at least one")
    layers = {l: LayerPlacement(e, linear_ranks(e, ranks)) for l, e in experts.items()}
    return Placement(ranks=ranks, layers=layers, ranks_per_node=min(ranks_per_node, ranks), model=dict(model or {}))


def _layer_from_json(doc, layer: str, where: str) -> LayerPlacement:
    try:
        e = int(doc["num_experts"])
        ranks = tuple(tuple(int(i) for i in ids) for ids in doc["ranks"])
    except (KeyError, TypeError, ValueError):
        raise MoekitError(f"{where}: layer {layer} needs num_experts and ranks (a list of expert-id lists)") from None
    held = {i for ids in ranks for i in ids}
    bad = sorted(i for i in held if not 0 <= i < e)
    if bad:
        raise MoekitError(f"{where}: layer {layer} places expert {bad[0]}, but the layer has {e} experts")
    missing = sorted(set(range(e)) - held)
    if missing:
        raise MoekitError(f"{where}: layer {layer} places no copy of expert {missing[0]}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    empty = [r for r, ids in enumerate(ranks) if not ids]
    if empty:
        raise MoekitError(f"{where}: layer {layer} gives rank {empty[0]} no expert")
    return LayerPlacement(e, ranks)


def read_placement(path: str | Path) -> Placement:
    """A placement file, checked on its own (every expert placed, ids in range, ranks consistent)."""
    path = Path(path)
    if not path.is_file():
        raise MoekitError(f"{path}: no such placement file (write one with `moekit placement TRACE --ranks N --out FILE`)")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MoekitError(f"{path}: not a JSON placement file") from None
    if not isinstance(doc, dict) or doc.get("format") != PLACEMENT_FORMAT:
        raise MoekitError(f"{path}: not a moekit placement file (no \"format\": \"{PLACEMENT_FORMAT}\")")
    try:
        ranks = int(doc["ranks"])
        raw = dict(doc["layers"])
        layers = {int(l): _layer_from_json(v, l, str(path)) for l, v in raw.items()}
    except (KeyError, TypeError, ValueError):
        raise MoekitError(f"{path}: a placement needs \"ranks\" and \"layers\"") from None
    for l, p in layers.items():
        if len(p.ranks) != ranks:
            raise MoekitError(f"{path}: layer {l} lists {len(p.ranks)} ranks, the file says {ranks}")
    return Placement(
        ranks=ranks,
        layers=layers,
        ranks_per_node=int(doc.get("ranks_per_node", RANKS_PER_NODE)),
        redundant=int(doc.get("redundant", 0)),
        model={k: doc.get(k) for k in ("model", "model_type", "config_sha256")},
        source=str(path),
    )


def check_placement(placement: Placement, experts: dict[int, int], world: int, model: dict, where: str) -> None:
    """Refuse a placement made for another model or another number of ranks (one clear line).

    experts: the model's MoE layer → E; model: its name, model_type and config_sha256."""
    theirs, ours = placement.model.get("config_sha256"), model.get("config_sha256")
    if theirs and ours and theirs != ours:
        raise MoekitError(f"{where}: the placement was made for {placement.model.get('model')!r} "
                          f"(another config.json), not {model.get('model')!r}")
    if set(placement.layers) != set(experts):
        raise MoekitError(f"{where}: the placement covers MoE layers {sorted(placement.layers)}, "
                          f"the model has {sorted(experts)}")
    for l, p in placement.layers.items():
        if p.num_experts != experts[l]:
            raise MoekitError(f"{where}: layer {l} has {experts[l]} experts, the placement {p.num_experts}")
    if placement.ranks != world:
        raise MoekitError(f"{where}: the placement is for {placement.ranks} ranks, this run has {world}")
