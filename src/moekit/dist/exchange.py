"""The arithmetic of one MoE layer's exchange, shared by the runtime (layer.py) and the simulator.

Every rank runs the same batch, so each token gets one home rank that dispatches its K (token,
expert) pairs and combines their outputs: the forward's T tokens are cut into R contiguous chunks,
the first T mod R one token longer (numpy's array_split), chunk r homed on rank r. A pair goes to
the rank `RouteTable.owners` names (the expert's copy for that token).

Legend: T tokens of the forward, K experts per token, R ranks, N pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moekit.dist.placement import RouteTable


def home_bounds(tokens: int, ranks: int) -> np.ndarray:
    """[R + 1] chunk boundaries: rank r is home to tokens [bounds[r], bounds[r + 1])."""
    q, extra = divmod(tokens, ranks)
    sizes = [q + (1 if r < extra else 0) for r in range(ranks)]
    return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


@dataclass(frozen=True)
class Dispatch:
    """What one home rank sends: its pairs sorted by destination rank, then expert, then token."""

    order: np.ndarray  # [N] pair indices into the home chunk's [T_home * K] pairs, in send order
    experts: np.ndarray  # [N] the logical expert of each sent row
    counts: np.ndarray  # [R] rows sent to each rank (itself included)
    begin: int  # the home chunk's first token in the forward
    end: int


def dispatch(topk_ids: np.ndarray, rank: int, ranks: int, table: RouteTable, forward: int) -> Dispatch:
    """topk_ids [T, K] of the whole forward → what `rank` sends.

    Sorted by expert within a destination, and chunks ascending with rank, the rows an owner
    receives for one expert are in token order: the same rows, in the same order, the single-process
    grouped forward gives that expert, so its matmul sees the very same matrix."""
    t, k = topk_ids.shape
    bounds = home_bounds(t, ranks)
    begin, end = int(bounds[rank]), int(bounds[rank + 1])
    experts = topk_ids[begin:end].reshape(-1).astype(np.int64)  # [T_home * K]
    pair = np.arange(len(experts))
    dest = table.owners(experts, begin + pair // k, forward)
    order = np.lexsort((pair, experts, dest))
    counts = np.bincount(dest, minlength=ranks).astype(np.int64)
    return Dispatch(order=order, experts=experts[order], counts=counts, begin=begin, end=end)


def traffic(topk_ids: np.ndarray, ranks: int, table: RouteTable, forward: int) -> np.ndarray:
    """[R, R] pairs: entry [h, d] counts pairs homed on rank h that rank d computes (the simulator's
    view of one forward; row h is rank h's `dispatch(...).counts`)."""
    t, k = topk_ids.shape
    experts = topk_ids.reshape(-1).astype(np.int64)
    tokens = np.arange(len(experts)) // k
    home = np.searchsorted(home_bounds(t, ranks), tokens, side="right") - 1
    dest = table.owners(experts, tokens, forward)
    return np.bincount(home * ranks + dest, minlength=ranks * ranks).reshape(ranks, ranks).astype(np.int64)
