"""Routed experts stored stacked, and two ways to run them: the obvious one and the fast one.

Weights: gate_up [E, 2F, D] (gate rows then up rows), down [E, D, F]; optional biases [E, 2F], [E, D].
`prepare()` (after loading) swaps each stack for E per-expert weights in its kernel's layout (see
moekit.model.linear; a stack whose kernel reads the Hub layout stays); `gate_up[e]` / `down[e]` is
expert e's weight either way.
`experts_reference` loops over tokens and their K experts, as one would on paper. `RoutedExperts`
groups tokens by expert (one pair of matmuls per expert that any token chose) and, for a single
token, just runs its K experts. tests/model/test_experts.py checks that the two agree.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from moekit import ops
from moekit.model.linear import PLAIN, TILES, int8_kernel_for, kernel_for
from moekit.model.mlp import Activation
from moekit.model import step_ops
from moekit.model.routing import RoutingDecision
from moekit.spec.model_spec import MLPSpec

class StandIn(NamedTuple):
    """An expert's low-precision copy run in its place (an expert store's miss served without a
    stall, HOBBIT): its weights and the kernels they are laid out for."""

    gate_up: torch.Tensor
    down: torch.Tensor
    kernels: tuple


# expert id → its prepared (gate_up, down), or a StandIn
WeightsOf = Callable[[int], Union[tuple[torch.Tensor, torch.Tensor], StandIn]]


class RoutedExperts(nn.Module):
    def __init__(self, spec: MLPSpec, num_experts: int, act: Activation):
        super().__init__()
        rows = (2 if spec.gated else 1) * spec.width
        self.num_experts = num_experts
        self.in_features = (spec.hidden_size, spec.width)  # gate_up's and down's input widths: D, F
        # (gate_up's, down's) [out, in] in our layout: known even once offload() drops the stacks.
        self.weight_shapes = ((rows, spec.hidden_size), (spec.hidden_size, spec.width))
        self.gate_up = nn.Parameter(torch.empty(num_experts, rows, spec.hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, spec.hidden_size, spec.width))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, rows)) if spec.bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, spec.hidden_size)) if spec.bias else None
        self.act = act
        self.kernels = (PLAIN, PLAIN)  # gate_up's and down's, set by prepare()
        # Per expert (gate_up's, down's) when an expert store holds this layer's experts at several
        # precisions (a profile's hot ones in bf16, the rest int4); None: `kernels` for all.
        self.expert_kernels: tuple | None = None
        self._weights: tuple[tuple, tuple] | None = None  # per-expert (gate_up, down), set by prepare()
        self.store = None  # a moekit.offload.store.LayerStore once the weights live there instead
        # Offloaded experts a checkpoint publishes packed (MXFP4, FP8): how the store keeps them
        # packed (moekit.model.packed_loading.PackedFormat), recorded by the loader; None otherwise.
        self.packed_format = None
        # After quantize_int8(): (gate_up [E, 2F, nb·34], down [E, D, nb·34]) uint8, the q8_0 stacks
        # the per-expert weights are views of; the compiled decode step reads them in place.
        self.int8_stacks: tuple[torch.Tensor, torch.Tensor] | None = None

    def offload(self) -> None:
        """Drop the (still meta) weight stacks: the routed weights will come from an expert store.
        Biases stay, they are a few numbers per expert."""
        del self.gate_up, self.down
        self.gate_up = self.down = None

    @property
    def offloaded(self) -> bool:
        return self.gate_up is None

    def prepare(self, kernels: bool = True) -> None:
        """Lay every expert's weights out for their kernel (moekit.model.linear.kernel_for), one
        expert at a time, dropping the stacks. kernels=False keeps the stacks (the plain kernel)."""
        if self.kept_packed:
            return  # laid out by keep_packed() straight from the checkpoint's bytes
        if self._weights is not None:
            raise RuntimeError("RoutedExperts.prepare called twice: the Hub layout is gone")
        if self.offloaded:
            return  # the store prepares each expert as it loads it (kernels_for_expert)
        chosen = []
        for name in ("gate_up", "down"):
            stack = getattr(self, name).detach()
            kernel = kernel_for(stack[0]) if kernels else PLAIN
            chosen.append(kernel)
            if kernel is PLAIN:
                continue  # the stack already is that layout
            delattr(self, name)
            per_expert = [nn.Parameter(kernel.prepare(stack[e]), requires_grad=False) for e in range(len(stack))]
            del stack
            setattr(self, name, nn.ParameterList(per_expert))
        # Plain tuples for the hot loop: ParameterList indexing costs microseconds per expert.
        self._weights = (tuple(self.gate_up), tuple(self.down))
        self.kernels = (chosen[0], chosen[1])

    kept_packed = False  # True once keep_packed() has set the weights

    def keep_packed(self, kernels: tuple, gate_up: list[torch.Tensor], down: list[torch.Tensor]) -> None:
        """Experts kept as the checkpoint stores them (MXFP4, FP8: moekit.ops.packed_layout), each expert's
        prepared bytes given, in place of the full-precision stacks, which are dropped unfilled."""
        self._hold(kernels, gate_up, down)
        self.kept_packed = True

    def _hold(self, kernels: tuple, gate_up, down) -> None:
        """Every expert's prepared (gate_up, down) for `kernels`, in place of the stacks."""
        del self.gate_up, self.down
        self.gate_up, self.down = (nn.ParameterList([nn.Parameter(w, requires_grad=False) for w in ws]) for ws in (gate_up, down))
        self._weights = (tuple(self.gate_up), tuple(self.down))
        self.kernels = (kernels[0], kernels[1])

    def tiles_fit(self) -> bool:
        """Whether lay_out_tiles applies: resident plain-kernel stacks, bf16, of widths that fit."""
        return (self.kernels == (PLAIN, PLAIN) and isinstance(self.gate_up, nn.Parameter)
                and ops.tiles_fit(self.gate_up) and ops.tiles_fit(self.down))

    def lay_out_tiles(self) -> None:
        """The stacks [E, out, in] (where tiles_fit), each expert in the tiles layout
        (moekit.ops.to_tiles), still one stack each: the compiled decode step's layout on an
        AMX machine."""
        if not self.tiles_fit():
            raise RuntimeError("RoutedExperts.lay_out_tiles: the stacks are not plain bf16 ones that fit the tiles")
        for name in ("gate_up", "down"):
            setattr(self, name, nn.Parameter(ops.to_tiles(getattr(self, name).detach()), requires_grad=False))
        self._weights = (tuple(self.gate_up), tuple(self.down))
        self.kernels = (TILES, TILES)

    def quantize_int8(self) -> None:
        """After prepare(): every expert's gate_up and down as q8_0 blocks (moekit.model.int8),
        one expert at a time from the Hub layout its kernel gives back."""
        if self.offloaded:
            return  # the store quantizes each expert as it loads it (moekit.offload.attach)
        if self._weights is None:
            raise RuntimeError("RoutedExperts.quantize_int8 before prepare()")
        stacks, kernels = [], []
        for weights, kernel, in_features in zip(self._weights, self.kernels, self.in_features):
            hub = torch.stack([kernel.hub(w, in_features) for w in weights])  # [E, out, in]
            int8 = int8_kernel_for(hub[0], hub.dtype)
            packed = int8.prepare(hub.flatten(0, 1)).view(len(weights), hub.shape[1], -1)  # one pass for all E
            del hub
            stacks.append(packed)
            kernels.append(int8)
        self._hold(kernels, *(tuple(packed.unbind(0)) for packed in stacks))  # expert e's blocks: a view
        self.int8_stacks = (stacks[0], stacks[1])

    def resident_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up, down) as this module holds them."""
        gate_up, down = self._weights if self._weights is not None else (self.gate_up, self.down)
        return gate_up[e], down[e]

    def replace_expert(self, e: int, weights: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's prepared (gate_up, down) ← `weights` (already laid out for self.kernels: a hot
        swap, or its rollback); returns the ones it replaces. Only what the forward reads changes:
        the loaded parameter stacks keep the checkpoint's values, except in the plain layout, where
        the stacks are what the forward reads."""
        if self._weights is None or self.store is not None:
            raise RuntimeError("replace_expert needs prepared, resident experts")
        stacked = self.kernels in ((PLAIN, PLAIN), (TILES, TILES)) and isinstance(self.gate_up, nn.Parameter)
        stacks = (self.gate_up, self.down) if stacked else self.int8_stacks
        if stacks is not None:
            # The stacks the compiled decode step reads in place (the Hub layout's or tiles', or the q8_0 ones
            # the per-expert weights are views of): the new expert is written into them, and a copy
            # of the old one is handed back.
            old = (stacks[0][e].clone(), stacks[1][e].clone())
            stacks[0][e].copy_(weights[0])
            stacks[1][e].copy_(weights[1])
            return old
        old = self.resident_weights(e)
        gate_up, down = self._weights
        self._weights = (gate_up[:e] + (weights[0],) + gate_up[e + 1 :], down[:e] + (weights[1],) + down[e + 1 :])
        return old

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x [N, D] → [N, D]."""
        return self.apply_expert(e, *self.resident_weights(e), x)

    def apply_expert(self, e: int, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
                     kernels: Optional[tuple] = None) -> torch.Tensor:
        """Expert e, whose prepared weights are given (resident or from a store), on x [N, D] → [N, D].
        kernels: the weights' own (a StandIn's), else the layer's for expert e."""
        up_bias = self.gate_up_bias[e] if self.gate_up_bias is not None else None
        down_bias = self.down_bias[e] if self.down_bias is not None else None
        if kernels is None:
            kernels = self.kernels if self.expert_kernels is None else self.expert_kernels[e]
        up_kernel, down_kernel = kernels
        h = up_kernel.apply(x, gate_up, up_bias)
        return down_kernel.apply(self.act(h), down, down_bias)

    def _run_expert(self, e: int, weights, x: torch.Tensor) -> torch.Tensor:
        """apply_expert with what a WeightsOf gave: (gate_up, down) or a StandIn."""
        if isinstance(weights, StandIn):
            return self.apply_expert(e, weights.gate_up, weights.down, x, weights.kernels)
        return self.apply_expert(e, *weights, x)

    def forward(self, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        """x [T, D] → Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t]), [T, D]."""
        if self.store is not None:
            return self.store.forward(self, x, decision)
        return self.combine(x, decision, self.resident_weights)

    def combine(self, x: torch.Tensor, decision: RoutingDecision, weights: WeightsOf) -> torch.Tensor:
        """The forward with expert e's weights from `weights(e)`. For several tokens it is asked in
        ascending e, once per expert used, each right before that expert runs (an expert store
        relies on this order); for one token, in router order."""
        if x.shape[0] == 1:
            return self._one_token(x, decision, weights)
        return self._grouped(x, decision, weights)

    # llama4: the routing weight scales the expert's INPUT, expert(w·x), and the output is added as is.
    # Set by MoE from MoESpec.weigh_input; an expert of a zero input gives exactly zero, so a row
    # repeated at weight 0 (route_rows) still adds nothing.
    weigh_input = False

    def _one_token(self, x: torch.Tensor, decision: RoutingDecision, weights: WeightsOf) -> torch.Tensor:
        if self.weigh_input:
            return self._one_token_weighed_input(x, decision, weights)
        ids = decision.topk_ids.tolist()[0]
        scales = decision.topk_weights.tolist()[0]  # Python floats: no tensor op per scalar
        out = self._run_expert(ids[0], weights(ids[0]), x).mul_(scales[0])
        for e, w in zip(ids[1:], scales[1:]):
            out.add_(self._run_expert(e, weights(e), x).mul_(w))  # in place, the same roundings as out + y·w
        return out

    def _one_token_weighed_input(self, x: torch.Tensor, decision: RoutingDecision, weights: WeightsOf) -> torch.Tensor:
        ids = decision.topk_ids.tolist()[0]
        scales = decision.topk_weights[0].to(x.dtype)  # [K] rounded as the reference rounds its scores
        out = self._run_expert(ids[0], weights(ids[0]), x * scales[0])
        for k, e in enumerate(ids[1:], start=1):
            out.add_(self._run_expert(e, weights(e), x * scales[k]))
        return out

    def _grouped(self, x: torch.Tensor, decision: RoutingDecision, weights: WeightsOf) -> torch.Tensor:
        top_k = decision.topk_ids.shape[1]
        flat_ids = decision.topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // top_k  # [T*K] the token of each sorted assignment
        weight_of = decision.topk_weights.reshape(-1)[order]
        chosen = x[token_of]  # [T*K, D]
        out = torch.zeros_like(x)
        begin = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(begin, begin + n)
            if self.weigh_input:
                y = self._run_expert(e, weights(e), chosen[rows] * weight_of[rows, None].to(x.dtype))
            else:
                y = self._run_expert(e, weights(e), chosen[rows]) * weight_of[rows, None]
            # One index_add_ per expert, as the reference does: in bf16 a single call over all
            # experts would round the sums differently.
            out.index_add_(0, token_of[rows], y.to(x.dtype))
            begin += n
        return out

    def decode(self, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        """The decode step's form (moekit.model.step_ops): Σ_k w[b, k] · expert_{ids[b, k]}(x[b])
        for x [B, D], every (row, choice) read in place from the stacks (Hub layout, tiles or q8_0)."""
        if not self._stacks_read(torch.compiler.is_compiling()):
            return self.forward(x, decision)  # the eager combine: these weights have no stack to read in place
        ids, w = decision.topk_ids, decision.topk_weights  # [B, K]
        if self.weigh_input:  # llama4: each choice's input weighed, [B, K, D], its output added as is
            x = x[:, None, :] * w[..., None].to(x.dtype)
            w = torch.ones_like(w)
        else:
            x = x[:, None, :]  # [B, 1, D]: every choice reads the row's one input
        if self.int8_stacks is not None:
            return self._decode_int8(x, ids, w)
        tiles = self.kernels == (TILES, TILES)
        if tiles:
            experts_tiles = ops.op("moekit", "experts_tiles")
            h = experts_tiles(x, self.gate_up, ids)  # [B, K, 2F]
        elif step_ops.has_gemv():
            kind = ops.kind_of(self.gate_up)
            gemv = step_ops.op_for(self.gate_up, "experts_gemv")
            h = gemv(step_ops.widened(x, kind), self.gate_up, ids, step_ops.grouped(kind)).to(x.dtype)  # [B, K, 2F]
        else:
            h = (x[:, :, None, :] * self.gate_up[ids]).sum(-1)  # indirect reads when compiled, no copy
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[ids]
        a = self.act(h)  # [B, K, F]
        if tiles:
            y = experts_tiles(a, self.down, ids)  # [B, K, D]
        elif step_ops.has_gemv():
            kind = ops.kind_of(self.down)
            gemv = step_ops.op_for(self.down, "experts_gemv")
            y = gemv(step_ops.widened(a, kind), self.down, ids, step_ops.grouped(kind)).to(a.dtype)  # [B, K, D]
        else:
            y = (a[:, :, None, :] * self.down[ids]).sum(-1)
        if self.down_bias is not None:
            y = y + self.down_bias[ids]
        return (y * w[..., None].to(y.dtype)).sum(1)  # [B, D]

    def _stacks_read(self, compiling: bool) -> bool:
        """Whether decode reads the chosen experts in place from stacks: resident Hub-layout, tiles
        or q8_0 stacks, with the operators loaded (eagerly, without them, the combine is faster than
        copying the chosen experts out of the stacks)."""
        if self.store is not None:
            return False
        if self.int8_stacks is not None:
            return step_ops.has_gemv()
        if self.kernels == (TILES, TILES):
            return True
        stacked = self.kernels == (PLAIN, PLAIN) and isinstance(self.gate_up, nn.Parameter)
        return stacked and (compiling or step_ops.has_gemv())

    def _decode_int8(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """decode with q8_0 expert stacks (moekit::experts_q8), x [B, 1 or K, D]; biases are at the
        engine dtype."""
        gate_up, down = self.int8_stacks
        experts_q8, grouped = step_ops.op_for(gate_up, "experts_q8"), step_ops.grouped("q8_0")
        h = experts_q8(x, gate_up, ids, grouped)  # [B, K, 2F]
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[ids]
        y = experts_q8(self.act(h), down, ids, grouped)  # [B, K, D]
        if self.down_bias is not None:
            y = y + self.down_bias[ids]
        return (y * w[..., None].to(y.dtype)).sum(1)  # [B, D]

def experts_reference(experts: RoutedExperts, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
    """The slow obvious sum: for every token, for each of its K experts, add weight × expert(token)
    (llama4's weigh_input: expert(weight × token))."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(decision.topk_ids.shape[1]):
            e = int(decision.topk_ids[t, k])
            w = decision.topk_weights[t, k]
            if experts.weigh_input:
                out[t] += experts.expert(e, x[t : t + 1] * w.to(x.dtype))[0]
                continue
            y = experts.expert(e, x[t : t + 1])[0]
            out[t] += (y * w).to(x.dtype)
    return out
