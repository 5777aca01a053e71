"""The expert-parallel MoE layer: what `RoutedExperts.forward` calls when the experts are sharded.

Installed as `RoutedExperts.store` (the hook the expert store uses), one per MoE layer, holding
only this rank's experts. Every rank routes the same batch identically, so per layer:

    home chunk's pairs ─► sort by (rank, expert, token) ─► all_to_all_single(counts)
    ─► all_to_all_single(rows, uneven splits) ─► local experts, one grouped pass
    ─► all_to_all_single(outputs back) ─► weighted sum in the single-process order
    ─► all_gather of the home chunks (every rank runs the next dense layer on the whole batch)

Exactness: an owner receives an expert's rows in token order (exchange.dispatch), so its matmul
sees the matrix the single-process grouped forward gives that expert. The home rank then adds a
token's K weighted outputs in the order RoutedExperts does: router order for a one-token forward,
ascending expert id (ties in router order) otherwise, starting from zero as index_add_ does.

Legend: T tokens, D hidden, K experts per token, R ranks, N rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from moekit.dist.exchange import dispatch, home_bounds
from moekit.dist.placement import RouteTable
from moekit.dist.rank_memory import shares_storage
from moekit.errors import MoekitError
from moekit.model.routing import RoutingDecision


class ExchangeError(MoekitError):
    """A collective of the expert-parallel exchange failed: a peer rank died, hung or disagreed."""


@dataclass
class ExchangeStats:
    """One layer's exchange on this rank, one entry per forward (the first is the prompt pass)."""

    pairs: list[int] = field(default_factory=list)  # (token, expert) pairs this rank computed
    dispatch_bytes: list[int] = field(default_factory=list)  # hidden rows sent to other ranks
    combine_bytes: list[int] = field(default_factory=list)  # expert outputs sent back to other ranks
    gather_bytes: list[int] = field(default_factory=list)  # home chunks sent in the all-gather
    tokens: list[int] = field(default_factory=list)  # T of the forward

    def as_dict(self) -> dict:
        return {k: list(v) for k, v in vars(self).items()}


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as gloo moves it: 16-bit floats travel as int16 bit patterns (bit-exact)."""
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


class ExpertParallelLayer:
    def __init__(self, layer: int, rank: int, ranks: int, table: RouteTable, weights: Optional[dict] = None,
                 inner=None, group=None, timeout_s: float = 0.0):
        """weights: logical expert → prepared (gate_up, down) this rank holds; or `inner`, an expert
        store's LayerStore that serves this rank's experts (--expert-memory per rank)."""
        self.layer, self.rank, self.ranks, self.table = layer, rank, ranks, table
        self.weights, self.inner, self.group, self.timeout_s = weights, inner, group, timeout_s
        self.forwards = 0
        self.stats = ExchangeStats()

    # --- collectives, each failure one clear line ---------------------------------------------------

    def _collective(self, what: str, fn) -> None:
        try:
            fn()
        except (RuntimeError, dist.DistError) as err:
            detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ExchangeError(f"rank {self.rank}: expert-parallel {what} at layer {self.layer} failed after at most "
                                f"{self.timeout_s:g}s: a peer rank died, hung or was stopped ({detail[:200]})") from None

    def _all_to_all(self, what: str, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        self._collective(what, lambda: dist.all_to_all_single(_wire(out), _wire(inp), output_split_sizes=out_splits,
                                                              input_split_sizes=in_splits, group=self.group))

    # --- the forward ------------------------------------------------------------------------------

    def _received_experts(self, ids: np.ndarray, forward: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows each rank sends here [R], the logical expert of every row received, in arrival order).
        Every rank holds the same decision, so the owner derives what the exchange will bring."""
        counts, experts = [], []
        for src in range(self.ranks):
            plan = dispatch(ids, src, self.ranks, self.table, forward)
            offsets = np.concatenate(([0], np.cumsum(plan.counts)))
            counts.append(int(plan.counts[self.rank]))
            experts.append(plan.experts[offsets[self.rank]: offsets[self.rank + 1]])
        return np.array(counts, dtype=np.int64), np.concatenate(experts)

    def _local(self, experts, rows: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
        """rows [N, D], each for logical expert ids[n] → each row's expert output [N, D]: the layer's
        own grouped forward with weight 1 per row (y·1 into zeros is y, exactly)."""
        unit = RoutingDecision(topk_ids=torch.from_numpy(ids).view(-1, 1).to(rows.device),
                               topk_weights=torch.ones(len(ids), 1, dtype=torch.float32, device=rows.device))
        if self.inner is not None:
            return self.inner.forward(experts, rows, unit)
        return experts.combine(rows, unit, self.weights.__getitem__)

    def forward(self, experts, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        """x [T, D] (the same on every rank) → Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t]), [T, D]."""
        forward, self.forwards = self.forwards, self.forwards + 1
        ids = decision.topk_ids.cpu().numpy()  # [T, K]
        t, k = ids.shape
        d = x.shape[1]
        plan = dispatch(ids, self.rank, self.ranks, self.table, forward)
        order = torch.from_numpy(plan.order).to(x.device)
        send = x[plan.begin: plan.end][order // k]  # [N_send, D] hidden rows, in send order
        if experts.weigh_input:  # llama4: the weight scales the expert's input, here on the home rank
            send = send * decision.topk_weights[plan.begin: plan.end].reshape(-1)[order].to(x.dtype)[:, None]

        send_counts = torch.from_numpy(plan.counts).to(x.device)  # NCCL moves device tensors only
        recv_counts = torch.empty_like(send_counts)
        self._all_to_all("count exchange", recv_counts, send_counts)
        expected, recv_ids = self._received_experts(ids, forward)
        if not np.array_equal(recv_counts.cpu().numpy(), expected):
            raise ExchangeError(f"rank {self.rank}: the ranks disagree on the routing at layer {self.layer} "
                                f"(counts {recv_counts.tolist()}, expected {expected.tolist()}): they are not "
                                f"running the same model on the same batch")
        sends, recvs = plan.counts.tolist(), expected.tolist()
        recv = x.new_empty((sum(recvs), d))
        self._all_to_all("dispatch", recv, send, recvs, sends)

        y = self._local(experts, recv, recv_ids) if len(recv_ids) else recv
        back = x.new_empty((len(plan.order), d))
        self._all_to_all("combine", back, y.contiguous(), sends, recvs)

        home = self._weighted_sum(x, decision, plan, back, single_token=t == 1,
                                  experts_weigh_input=experts.weigh_input)
        out = self._gather(home, t)
        size = x.element_size() * d
        self.stats.pairs.append(sum(recvs))
        self.stats.dispatch_bytes.append((sum(sends) - sends[self.rank]) * size)
        self.stats.combine_bytes.append((sum(recvs) - recvs[self.rank]) * size)
        self.stats.gather_bytes.append(int(home_bounds(t, self.ranks)[1]) * size * (self.ranks - 1))
        self.stats.tokens.append(t)
        return out

    def _weighted_sum(self, x, decision, plan, back: torch.Tensor, single_token: bool,
                      experts_weigh_input: bool = False) -> torch.Tensor:
        """The home chunk's outputs [T_home, D]: each token's K (output · weight) added from zero in
        RoutedExperts' order (router order for one token; else ascending expert id, ties by k)."""
        k = decision.topk_ids.shape[1]
        rows = plan.end - plan.begin
        per_pair = back.new_empty((rows * k, back.shape[1]))
        per_pair[torch.from_numpy(plan.order).to(x.device)] = back
        weights = decision.topk_weights[plan.begin: plan.end].reshape(-1, 1)  # [T_home*K, 1] fp32
        if experts_weigh_input:  # already applied to the rows sent (llama4): y·1 is y exactly
            weights = torch.ones_like(weights)
        terms = (per_pair * weights).to(x.dtype).view(rows, k, x.shape[1])  # [T_home, K, D]
        if single_token:
            slots = torch.arange(k, device=x.device).expand(rows, k)
        else:
            slots = torch.sort(decision.topk_ids[plan.begin: plan.end], dim=1, stable=True).indices  # [T_home, K]
        out = torch.zeros((rows, x.shape[1]), dtype=x.dtype, device=x.device)
        index = torch.arange(rows, device=x.device)
        for j in range(k):
            out += terms[index, slots[:, j]]
        return out

    def _gather(self, home: torch.Tensor, tokens: int) -> torch.Tensor:
        """Every rank's home chunk → the whole [T, D] on every rank (chunks padded to the first's size)."""
        bounds = home_bounds(tokens, self.ranks)
        width = int(bounds[1])
        padded = home.new_zeros((width, home.shape[1]))
        padded[: home.shape[0]] = home
        parts = [torch.empty_like(padded) for _ in range(self.ranks)]
        self._collective("all-gather", lambda: dist.all_gather([_wire(p) for p in parts], _wire(padded), group=self.group))
        return torch.cat([parts[r][: int(bounds[r + 1] - bounds[r])] for r in range(self.ranks)])


def take_local(experts, local: tuple[int, ...]) -> dict:
    """This rank's experts' prepared weights; the module's own copies of all experts are released.

    A weight that shares its storage with more (a view into the stacked [E, ...] tensor, or into
    the one buffer a loader filled for the whole checkpoint) is copied out, or it would keep all of
    that (every rank's experts, and the dense weights) alive."""
    kept = {}
    for e in local:
        kept[e] = tuple(w.clone() if shares_storage(w) else w for w in experts.resident_weights(e))
    experts.offload()  # its form too, which held the prepared weights for the hot loop
    return kept

