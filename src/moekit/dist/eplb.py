"""Expert placement with redundant replicas, after the hierarchical balancing DeepSeek published
with EPLB (written here from its description): pack expert groups to nodes, replicate the heaviest
experts within each node, pack the physical experts to the node's ranks.

Three pure functions over numpy arrays, each a batch of independent rows (one per MoE layer, or per
layer and node):

  balanced_packing  items → packs of equal item count, heaviest item first into the lightest pack
  replicate         n logical items → m ≥ n physical copies, each extra copy to the item whose
                    load per copy is largest
  rebalance         the hierarchy above → for every layer, the logical expert of each physical slot

Loads are (token, expert) pair counts from a routing trace; ties break towards the lower index, so
a plan is a pure function of the trace.
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, packs: int, ident: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """weight [X, n] loads of n items per row → (pack [X, n], slot [X, n]): the pack of each item
    and its position in the pack. Every pack gets n / packs items; items go heaviest first to the
    pack with the smallest load among those with room. ident [X, n] (optional): which logical item
    each is; a copy then goes to a pack that lacks that item while one with room does, since a second
    copy on the same rank fills a slot without taking load off any other."""
    rows, n = weight.shape
    if n % packs:
        raise ValueError(f"{n} items do not split into {packs} equal packs")
    per = n // packs
    pack = np.zeros((rows, n), dtype=np.int64)
    slot = np.zeros((rows, n), dtype=np.int64)
    load = np.zeros((rows, packs), dtype=np.float64)
    filled = np.zeros((rows, packs), dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")  # heaviest first, lower index on ties
    every = np.arange(rows)
    holds = np.zeros((rows, packs, int(ident.max()) + 1 if ident is not None else 0), dtype=bool)
    for i in range(n):
        item = order[:, i]
        open_load = np.where(filled < per, load, np.inf)
        if ident is not None:
            who = ident[every, item]
            apart = np.where(holds[every, :, who], np.inf, open_load)
            open_load = np.where(np.isfinite(apart).any(axis=1, keepdims=True), apart, open_load)
        target = np.argmin(open_load, axis=1)  # the lightest pack with room, lowest index on ties
        pack[every, item] = target
        slot[every, item] = filled[every, target]
        load[every, target] += weight[every, item]
        filled[every, target] += 1
        if ident is not None:
            holds[every, target, who] = True
    return pack, slot


def replicate(weight: np.ndarray, physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [X, n] → (phy2log [X, physical], replica [X, physical], count [X, n]): the logical
    item of each physical slot (the first n slots are items 0..n-1 themselves), which copy of it the
    slot is, and the copies per item. Each extra copy goes to the item of largest weight / copies."""
    rows, n = weight.shape
    if physical < n:
        raise ValueError(f"{physical} physical slots cannot hold {n} items")
    phy2log = np.tile(np.arange(physical, dtype=np.int64), (rows, 1))
    replica = np.zeros((rows, physical), dtype=np.int64)
    count = np.ones((rows, n), dtype=np.int64)
    every = np.arange(rows)
    for p in range(n, physical):
        item = np.argmax(weight / count, axis=1)
        phy2log[:, p] = item
        replica[:, p] = count[every, item]
        count[every, item] += 1
    return phy2log, replica, count


def rebalance(weight: np.ndarray, physical: int, groups: int, nodes: int, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """weight [L, E] pair counts per layer and logical expert → (phy2log [L, physical], count [L, E]).

    Physical slot p lives on rank p // (physical / ranks). Hierarchical when the E experts form
    `groups` groups that the nodes divide (pack groups to nodes, then replicate and pack per node);
    otherwise one global pool (nodes = groups = 1), as DeepSeek's EPLB does."""
    layers, experts = weight.shape
    if physical % ranks or ranks % nodes or experts % groups:
        raise ValueError("physical slots must split over ranks, ranks over nodes, experts into groups")
    if groups % nodes:
        groups, nodes = 1, 1
    weight = weight.astype(np.float64)
    group_size, per_node = experts // groups, physical // nodes
    ranks_per_node = ranks // nodes

    # 1. groups → nodes, balancing the groups' loads.
    group_load = weight.reshape(layers, groups, group_size).sum(axis=2)  # [L, G]
    node_of_group, slot_of_group = balanced_packing(group_load, nodes)
    # The experts in node order: node 0's groups (by slot), then node 1's, ...
    position = (node_of_group * (groups // nodes) + slot_of_group)[:, :, None] * group_size + np.arange(group_size)
    node_order = np.zeros((layers, experts), dtype=np.int64)  # [L, E] node-ordered index → logical expert
    np.put_along_axis(node_order, position.reshape(layers, experts), np.arange(experts)[None, :].repeat(layers, 0), 1)

    # 2. replicate within each node: [L * nodes, E / nodes] rows.
    node_weight = np.take_along_axis(weight, node_order, 1).reshape(layers * nodes, experts // nodes)
    phy2node, _, node_count = replicate(node_weight, per_node)

    # 3. the node's physical experts → its ranks, by load per copy.
    per_copy = np.take_along_axis(node_weight / node_count, phy2node, 1)  # [L * nodes, per_node]
    rank_of, slot_of = balanced_packing(per_copy, ranks_per_node, ident=phy2node)
    final = rank_of * (per_node // ranks_per_node) + slot_of  # position of each physical in its node
    in_node = np.zeros_like(phy2node)
    np.put_along_axis(in_node, final, phy2node, 1)  # [L * nodes, per_node] node-local expert index

    # Back to logical ids: node-local index → node-ordered index → logical expert.
    offsets = (np.arange(nodes) * (experts // nodes))[None, :, None]
    ordered = (in_node.reshape(layers, nodes, per_node) + offsets).reshape(layers, physical)
    phy2log = np.take_along_axis(node_order, ordered, 1)
    count = np.zeros((layers, experts), dtype=np.int64)
    for l in range(layers):
        count[l] = np.bincount(phy2log[l], minlength=experts)
    return phy2log, count
