"""From a trace to a placement: per-layer expert loads → eplb.rebalance → a Placement.

Loads are the (token, expert) pairs of every forward in the trace. The plan is made on the trace it
is then scored on (in-sample), as a deployment replans on a recent window of traffic.
"""

from __future__ import annotations

import numpy as np

from moekit.dist.eplb import rebalance
from moekit.dist.placement import RANKS_PER_NODE, LayerPlacement, Placement
from moekit.dist.simulate import Forwards
from moekit.errors import MoekitError


def expert_loads(forwards: Forwards) -> dict[int, np.ndarray]:
    """MoE layer → [E] pairs routed to each expert over the trace."""
    return {l: np.bincount(np.concatenate([f.reshape(-1) for f in fwd]), minlength=forwards.experts[l])
            for l, fwd in forwards.layers.items()}


def split_forwards(forwards: Forwards, heldout: float = 0.25) -> tuple[Forwards, Forwards]:
    """(the first part, the last `heldout` share of the tokens): a plan fitted to the first is scored
    on the second, tokens it never saw. Whole forwards when there are several (a prefill, then decode
    steps), else the one forward's tokens in order."""
    from dataclasses import replace

    first = next(iter(forwards.layers.values()))
    sizes = np.array([len(ids) for ids in first])
    if len(sizes) > 1:
        cut = int(np.searchsorted(np.cumsum(sizes), (1 - heldout) * sizes.sum()))
        cut = min(max(cut, 1), len(sizes) - 1)
        return (replace(forwards, layers={l: f[:cut] for l, f in forwards.layers.items()}),
                replace(forwards, layers={l: f[cut:] for l, f in forwards.layers.items()}))
    cut = min(max(int((1 - heldout) * sizes[0]), 1), max(sizes[0] - 1, 1))
    return (replace(forwards, layers={l: [f[0][:cut]] for l, f in forwards.layers.items()}),
            replace(forwards, layers={l: [f[0][cut:]] for l, f in forwards.layers.items()}))


def default_redundant(experts: int, ranks: int) -> int:
    """The fewest spare slots that give every rank the same count, and at least one spare per rank
    when the experts already split evenly (replicas are what lets a plan beat linear)."""
    physical = -(-experts // ranks) * ranks
    return physical - experts if physical > experts else ranks


def check_shape(experts: int, ranks: int, redundant: int, ranks_per_node: int) -> None:
    if ranks < 1 or redundant < 0:
        raise MoekitError(f"--ranks must be at least 1 and --redundant at least 0, got {ranks} and {redundant}")
    if (experts + redundant) % ranks:
        raise MoekitError(f"{experts} experts + {redundant} redundant = {experts + redundant} physical experts do not "
                          f"divide over {ranks} ranks: choose --redundant so that {ranks} divides the sum")
    if experts + redundant < ranks:
        raise MoekitError(f"{ranks} ranks but only {experts + redundant} physical experts: every rank must hold one")
    if ranks > ranks_per_node and ranks % ranks_per_node:
        raise MoekitError(f"{ranks} ranks do not fill nodes of {ranks_per_node}")


def eplb_placement(forwards: Forwards, ranks: int, redundant: int, ranks_per_node: int = RANKS_PER_NODE,
                   groups: int = 0) -> Placement:
    """groups: expert groups of the router (DeepSeek's n_group); 0 means one group per expert."""
    loads = expert_loads(forwards)
    layers = sorted(loads)
    experts = {forwards.experts[l] for l in layers}
    if len(experts) != 1:
        raise MoekitError("the MoE layers have different expert counts: plan them one count at a time")
    e = experts.pop()
    rpn = min(ranks_per_node, ranks)
    check_shape(e, ranks, redundant, rpn)
    groups = groups or e
    if e % groups:
        raise MoekitError(f"{e} experts do not form {groups} equal groups")
    physical = e + redundant
    phy2log, _ = rebalance(np.stack([loads[l] for l in layers]), physical, groups, ranks // rpn, ranks)
    per_rank = physical // ranks
    placed = {l: LayerPlacement(e, tuple(tuple(int(x) for x in phy2log[i, r * per_rank:(r + 1) * per_rank])
                                         for r in range(ranks)))
              for i, l in enumerate(layers)}
    return Placement(ranks=ranks, layers=placed, ranks_per_node=rpn, redundant=redundant, model=dict(forwards.model),
                     source="eplb")
