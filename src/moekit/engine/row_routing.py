"""Each row of a running batch routed its own way: by a request's routing policy, or exactly at its K.

Continuous batching puts requests of different policies in one decode step. The router of every
MoE layer gets logits [B*T, E] for the B rows, row-major; each row is routed on its own slice, a
row with a policy by that request's own PolicyRun (whose state — ema's average, reuse's last
experts — belongs to the request and follows it when its row moves), a row without one exactly at
its tier's K (route_rows). Routing is row-wise, so a row's decision is what it gets alone; rows
narrower than the widest repeat their first expert at weight 0, as route_rows pads them.
A batch-level policy (capacity, loadaware: routing_policies.BATCH_LEVEL) is the exception by
design: its rows share one PolicyRun and are routed as one batch, so "the load in the current
batch" is the load of every row of the step that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from moekit.model.routing import PolicyRun, RoutingDecision, route_rows


@dataclass
class RowRouting:
    """runs[r]: row r's PolicyRun, or None for exact routing at top_k[r] experts."""

    runs: Sequence[Optional[PolicyRun]]
    top_k: Sequence[int]

    def width(self, model_k: int) -> int:
        """Experts per token the rows' decisions can hold (a decode step's width): the widest of
        each run's policy and each exact row's K."""
        return max((k if run is None else run.width(model_k) for run, k in zip(self.runs, self.top_k)), default=model_k)

    def at(self, layer: int) -> "LayerRows":
        return LayerRows(self, layer)


@dataclass
class LayerRows:
    rows: RowRouting
    layer: int

    def route(self, logits: torch.Tensor, spec, selection_bias, inputs: Optional[torch.Tensor] = None) -> RoutingDecision:
        """logits [B*T, E] (inputs [B*T, D]: the router's input, for policies keyed on it) → the
        decision of every row's tokens, [B*T, K_max] row-major. Rows that share one PolicyRun (a
        batch-level policy's) are routed together, that run seeing them as one batch of rows."""
        runs = self.rows.runs
        t = logits.shape[0] // len(runs)
        parts: list[Optional[RoutingDecision]] = [None] * len(runs)
        for r, run in enumerate(runs):
            if run is None:
                parts[r] = route_rows(logits[r * t : (r + 1) * t], spec, selection_bias, [self.rows.top_k[r]] * t)
        for run, members in shared_runs(runs):
            tokens = torch.cat([torch.arange(r * t, (r + 1) * t) for r in members]).to(logits.device)  # [n*T]
            part = run.at(self.layer, len(members)).route(logits[tokens], spec, selection_bias,
                                                           None if inputs is None else inputs[tokens])
            for i, r in enumerate(members):
                parts[r] = RoutingDecision(topk_ids=part.topk_ids[i * t : (i + 1) * t],
                                           topk_weights=part.topk_weights[i * t : (i + 1) * t])
        return stack_decisions(parts)


def shared_runs(runs: Sequence[Optional[PolicyRun]]) -> list[tuple[PolicyRun, list[int]]]:
    """Each distinct run (by identity) with the rows it routes, in row order."""
    groups: dict[int, tuple[PolicyRun, list[int]]] = {}
    for r, run in enumerate(runs):
        if run is not None:
            groups.setdefault(id(run), (run, []))[1].append(r)
    return list(groups.values())


def stack_decisions(parts: list[RoutingDecision]) -> RoutingDecision:
    """Decisions of consecutive token blocks → one, narrower blocks padded with their first expert
    at weight 0 (the combine adds exactly nothing for a pad and reads no expert not chosen)."""
    width = max(p.topk_ids.shape[1] for p in parts)
    ids, weights = [], []
    for p in parts:
        pad = width - p.topk_ids.shape[1]
        if pad:
            ids.append(torch.cat([p.topk_ids, p.topk_ids[:, :1].expand(-1, pad)], dim=1))  # [T, K_max]
            weights.append(torch.cat([p.topk_weights.float(), p.topk_weights.new_zeros((p.topk_weights.shape[0], pad)).float()], dim=1))
        else:
            ids.append(p.topk_ids)
            weights.append(p.topk_weights.float())
    return RoutingDecision(topk_ids=torch.cat(ids), topk_weights=torch.cat(weights))
