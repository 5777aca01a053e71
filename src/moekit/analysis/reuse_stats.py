"""Reuse between consecutive tokens, co-activation within a layer, and how well one layer's choice
predicts the next layer's (the headroom a cross-layer prefetcher has), from a routing trace.

A token is (row, position); its predecessor is (row, position - 1) at the same layer. The prefetch
predictor is fit on the even-numbered tokens and scored on the odd ones, so it is not graded on
what it memorised: given layer l's top-1 expert, guess the K experts layer l+1 chose most often
after it (the most popular ones when that expert was never seen), against guessing layer l+1's
most popular K for every token.
"""

from __future__ import annotations

import numpy as np

from moekit.analysis.trace_data import RoutingTrace

TOP_PAIRS = 5


def token_keys(trace: RoutingTrace) -> np.ndarray:
    """[N] one int per (row, position)."""
    return trace.row * (int(trace.position.max()) + 2) + trace.position


def _layer_view(trace: RoutingTrace, layer: int):
    """The layer's entries sorted by token: (keys [n], one-hot [n, E], top-1 [n], position [n])."""
    sel = np.flatnonzero(trace.layer == layer)
    keys = token_keys(trace)[sel]
    order = np.argsort(keys, kind="stable")
    sel = sel[order]
    return keys[order], _onehot_rows(trace, layer, sel), trace.ids[sel, 0], trace.position[sel]


def _onehot_rows(trace: RoutingTrace, layer: int, rows: np.ndarray) -> np.ndarray:
    ids = trace.ids[rows]
    out = np.zeros((len(rows), trace.experts[layer]), dtype=bool)
    r, c = np.nonzero(ids >= 0)
    out[r, ids[r, c]] = True
    return out


def _lookup(keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Index into sorted `keys` of each wanted key, -1 where absent."""
    at = np.clip(np.searchsorted(keys, wanted), 0, max(0, len(keys) - 1))
    return np.where((len(keys) > 0) & (keys[at] == wanted), at, -1)


def reuse(trace: RoutingTrace) -> dict:
    out = {}
    for layer in trace.layers:
        keys, hot, _, pos = _layer_view(trace, layer)
        prev = np.where(pos > 0, _lookup(keys, keys - 1), -1)
        has = prev >= 0
        if not has.any():
            out[str(layer)] = {"pairs": 0, "same_experts": None, "overlap": None}
            continue
        cur, before = hot[has], hot[prev[has]]
        inter = (cur & before).sum(axis=1)
        same = (inter == cur.sum(axis=1)) & (inter == before.sum(axis=1))
        out[str(layer)] = {"pairs": int(has.sum()), "same_experts": float(same.mean()),
                           "overlap": float((inter / cur.sum(axis=1)).mean())}
    return out


def coactivation_matrix(trace: RoutingTrace, layer: int) -> np.ndarray:
    """[E, E] tokens of `layer` that chose both experts; the diagonal is each expert's load.

    Counted as pairs, not as the product onehot.T @ onehot (the plain definition, which
    tests/analysis/test_trace_stats.py holds this to): numpy multiplies int64 matrices in a plain
    loop, ~1.6 s a layer of `moekit report`'s ~10k tokens × 128 experts, and a float64 product
    goes to OpenBLAS's threads, which wait on each other for ~0.2 s on a loaded 2-core machine.
    A token's pairs are its K² (first, second) choices, which are distinct (RoutingTrace.ids)."""
    ids = trace.ids[trace.layer == layer]  # [n, K], -1 where a token chose fewer
    n_experts = trace.experts[layer]
    pairs = ids[:, :, None] * n_experts + ids[:, None, :]  # [n, K, K]
    both = (ids >= 0)[:, :, None] & (ids >= 0)[:, None, :]
    return np.bincount(pairs[both], minlength=n_experts * n_experts).reshape(n_experts, n_experts).astype(np.int64)


def coactivation(trace: RoutingTrace) -> dict:
    """Per layer: the [E, E] counts of tokens choosing both experts, and the most frequent pairs
    with their lift (observed over what independent choices would give)."""
    out = {}
    for layer in trace.layers:
        both = coactivation_matrix(trace, layer)
        n = int((trace.layer == layer).sum())
        load = np.diag(both).astype(np.float64)
        upper = np.triu(both, k=1)
        flat = np.argsort(upper, axis=None)[::-1][:TOP_PAIRS]
        pairs = []
        for f in flat:
            a, b = divmod(int(f), both.shape[0])
            if upper[a, b] == 0:
                break
            pairs.append({"experts": [a, b], "tokens": int(upper[a, b]),
                          "lift": float(upper[a, b] * n / (load[a] * load[b]))})
        out[str(layer)] = {"top_pairs": pairs,
                           "distinct_pairs": int((upper > 0).sum()),
                           "possible_pairs": both.shape[0] * (both.shape[0] - 1) // 2}
    return out


def _recall(guess: np.ndarray, hot: np.ndarray) -> float:
    """guess [n, G] expert ids, hot [n, E] → mean share of each token's experts that were guessed."""
    hit = np.take_along_axis(hot, guess, axis=1).sum(axis=1)
    return float((hit / hot.sum(axis=1)).mean())


def prefetch_headroom(trace: RoutingTrace) -> dict:
    out = {}
    layers = trace.layers
    for here, there in zip(layers, layers[1:]):
        keys_a, _, top1_a, _ = _layer_view(trace, here)
        keys_b, hot_b, _, _ = _layer_view(trace, there)
        at = _lookup(keys_a, keys_b)
        ok = at >= 0
        top1, hot = top1_a[at[ok]], hot_b[ok]
        fit, score = np.arange(len(hot)) % 2 == 0, np.arange(len(hot)) % 2 == 1
        if not score.any():
            continue
        k = int(round(hot.sum(axis=1).mean()))
        popular = np.argsort(-hot[fit].sum(axis=0), kind="stable")[:k]
        table = np.zeros((trace.experts[here], hot.shape[1]))
        np.add.at(table, top1[fit], hot[fit])
        table += 1e-9 * hot[fit].sum(axis=0)  # unseen top-1: the popular ones
        guess = np.argsort(-table[top1[score]], axis=1, kind="stable")[:, :k]
        out[f"{here}->{there}"] = {
            "tokens_scored": int(score.sum()),
            "guessed": k,
            "recall_from_previous_layer": _recall(guess, hot[score]),
            "recall_most_popular": _recall(np.broadcast_to(popular, (int(score.sum()), k)), hot[score]),
        }
    return out
