"""Routed experts stored stacked, and two ways to run them: the obvious one and the fast one.

Weights: gate_up [E, 2F, D] (gate rows then up rows), down [E, D, F]; optional biases [E, 2F], [E, D].
`prepare()` (after loading) swaps each stack for E per-expert weights in its kernel's layout (see
moekit.model.linear; a stack whose kernel reads the Hub layout stays); `gate_up[e]` / `down[e]` is
expert e's weight either way. How the loaded weights are held and run (resident stacks, per expert,
q8_0, packed, paged by a store) is the module's ExpertsForm (moekit.model.expert_forms).
`experts_reference` loops over tokens and their K experts, as one would on paper. `RoutedExperts`
groups tokens by expert (one pair of matmuls per expert that any token chose) and, for a single
token, just runs its K experts. tests/model/test_experts.py checks that the two agree.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import nn

from moekit import ops
from moekit.model.expert_forms import ExpertsForm, Packed, Paged, Stacks, resident_form
from moekit.model.linear import PLAIN, ROWS, TILES, int8_kernel_for, kernel_for
from moekit.model.mlp import Activation
from moekit.ops.torch_private import grouped_mm
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
    """A layer's routed experts: the parameter stacks a checkpoint fills, then, once loaded, one
    ExpertsForm (moekit.model.expert_forms) that holds the weights as prepared and runs them."""

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
        # Set where the weights are loaded (prepare, keep_packed, quantize_int8, lay_out_tiles,
        # offload; moekit.offload.attach for the store); None until then: the parameter stacks as
        # they are (training, an unprepared decoder).
        self.form: ExpertsForm | None = None

    @property
    def held(self) -> ExpertsForm:
        """The form, or for a module not yet prepared its parameter stacks, read as they are now."""
        return self.form if self.form is not None else Stacks((PLAIN, PLAIN), *map(tuple, (self.gate_up, self.down)),
                                                              stacks=(self.gate_up, self.down))

    @property
    def kernels(self) -> tuple:
        """(gate_up's, down's) kernel."""
        return self.held.kernels

    @property
    def store(self):
        """The store serving these experts (Paged form), else None."""
        return self.form.store if isinstance(self.form, Paged) else None

    @store.setter
    def store(self, store) -> None:
        """Put `store` in front of these experts (expert parallelism's layer over resident or paged
        ones); the kernels, and a store's per-expert ones, stay those of the form it replaces."""
        form = self.held
        self.form = Paged(form.kernels, store=store, expert_kernels=getattr(form, "expert_kernels", None),
                          packed=getattr(form, "packed", None))

    @property
    def packed_format(self):
        """How MXFP4 / FP8 experts are kept packed (moekit.model.packed_loading.PackedFormat), else None."""
        form = self.form
        return form.format if isinstance(form, Packed) else getattr(form, "packed", None)

    @property
    def kept_packed(self) -> bool:
        return isinstance(self.form, Packed)

    def offload(self, packed=None) -> None:
        """Drop the (still meta) weight stacks: the routed weights will come from a store (attach_store).
        Biases stay, they are a few numbers per expert. packed: how the store will keep MXFP4 / FP8
        experts packed, recorded by the loader."""
        if self.gate_up is not None:
            del self.gate_up, self.down
            self.gate_up = self.down = None
        kernels = self.form.kernels if self.form is not None else (PLAIN, PLAIN)
        self.form = Paged(kernels, packed=packed)

    @property
    def offloaded(self) -> bool:
        return self.gate_up is None

    def prepare(self, kernels: bool = True, operators: bool = False) -> None:
        """Lay every expert's weights out for their kernel (moekit.model.linear.kernel_for), one
        expert at a time, dropping the stacks. kernels=False keeps the stacks (the plain kernel);
        so does the rows kernel (operators: the command loaded them), which the decode step reads
        in place (moekit::experts_gemv)."""
        if isinstance(self.form, (Packed, Paged)):
            return  # laid out by keep_packed() from the checkpoint's bytes, or by the store as it loads each expert
        if self.form is not None:
            raise RuntimeError("RoutedExperts.prepare called twice: the Hub layout is gone")
        chosen = []
        for name in ("gate_up", "down"):
            stack = getattr(self, name).detach()
            kernel = kernel_for(stack[0], operators) if kernels else PLAIN
            chosen.append(kernel)
            if kernel in (PLAIN, ROWS):
                continue  # the stack already is that layout
            delattr(self, name)
            per_expert = [nn.Parameter(kernel.prepare(stack[e]), requires_grad=False) for e in range(len(stack))]
            del stack
            setattr(self, name, nn.ParameterList(per_expert))
        self.form = resident_form((chosen[0], chosen[1]), self.gate_up, self.down)

    def keep_packed(self, kernels: tuple, gate_up: list[torch.Tensor], down: list[torch.Tensor], packed) -> None:
        """Experts kept as the checkpoint stores them (MXFP4, FP8: moekit.ops.packed_layout), each expert's
        prepared bytes given, in place of the full-precision stacks, which are dropped unfilled. They
        are held stacked [E, out, bytes] (expert e's weights views of them), the stacks the compiled
        step reads in place. packed: the checkpoint's format (moekit.model.packed_loading.PackedFormat)."""
        del self.gate_up, self.down
        self.gate_up, self.down = (nn.Parameter(torch.stack(ws), requires_grad=False) for ws in (gate_up, down))
        self.form = resident_form(kernels, self.gate_up, self.down, packed=packed)

    def _hold(self, gate_up, down) -> None:
        """Every expert's prepared (gate_up, down) as this module's parameters, in place of the stacks."""
        del self.gate_up, self.down
        self.gate_up, self.down = (nn.ParameterList([nn.Parameter(w, requires_grad=False) for w in ws]) for ws in (gate_up, down))

    def tiles_fit(self) -> bool:
        """Whether lay_out_tiles applies: resident plain-kernel stacks, bf16, of widths that fit."""
        return (type(self.form) is Stacks and self.kernels == (PLAIN, PLAIN)
                and ops.tiles_fit(self.gate_up) and ops.tiles_fit(self.down))

    def lay_out_tiles(self) -> None:
        """The stacks [E, out, in] (where tiles_fit), each expert in the tiles layout
        (moekit.ops.to_tiles), still one stack each: the compiled decode step's layout on an
        AMX machine."""
        if not self.tiles_fit():
            raise RuntimeError("RoutedExperts.lay_out_tiles: the stacks are not plain bf16 ones that fit the tiles")
        for name in ("gate_up", "down"):
            setattr(self, name, nn.Parameter(ops.to_tiles(getattr(self, name).detach()), requires_grad=False))
        self.form = resident_form((TILES, TILES), self.gate_up, self.down)

    def quantize_int8(self) -> None:
        """After prepare(): every expert's gate_up and down as q8_0 blocks (moekit.model.int8),
        one expert at a time from the Hub layout its kernel gives back."""
        if isinstance(self.form, Paged):
            return  # the store quantizes each expert as it loads it (moekit.offload.attach)
        if self.form is None:
            raise RuntimeError("RoutedExperts.quantize_int8 before prepare()")
        stacks, kernels = [], []
        form = self.form
        for weights, kernel, in_features in zip((form.gate_up, form.down), form.kernels, self.in_features):
            hub = torch.stack([kernel.hub(w, in_features) for w in weights])  # [E, out, in]
            int8 = int8_kernel_for(hub[0], hub.dtype)
            packed = int8.prepare(hub.flatten(0, 1)).view(len(weights), hub.shape[1], -1)  # one pass for all E
            del hub
            stacks.append(packed)
            kernels.append(int8)
        self._hold(*(tuple(packed.unbind(0)) for packed in stacks))  # expert e's blocks: a view
        # The stacks the compiled step reads, held by the module too: a compiled graph may keep only
        # tensors the decoder holds by name (direct_graph.named_held), and one that read stacks held
        # by the form alone was never saved: every later server traced its int8 graphs again
        # (3-4 s a prefill graph, against ~0.1 s to load a saved one).
        self.int8_stacks = (stacks[0], stacks[1])
        self.form = resident_form((kernels[0], kernels[1]), self.gate_up, self.down, int8_stacks=self.int8_stacks)

    def resident_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up, down) as this module holds them."""
        return self.held.weights(e)

    def replace_expert(self, e: int, weights: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's prepared (gate_up, down) ← `weights` (already laid out for self.kernels: a hot
        swap, or its rollback); returns the ones it replaces. Only what the forward reads changes:
        the loaded parameters keep the checkpoint's values, except where the form's stacks are what
        the forward reads (Hub layout, tiles, q8_0)."""
        if self.form is None:
            raise RuntimeError("replace_expert needs prepared, resident experts")
        return self.form.replace(e, weights)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x [N, D] → [N, D]."""
        return self.apply_expert(e, *self.resident_weights(e), x)

    def apply_expert(self, e: int, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
                     kernels: Optional[tuple] = None) -> torch.Tensor:
        """Expert e, whose prepared weights are given (resident or from a store), on x [N, D] → [N, D].
        kernels: the weights' own (a StandIn's), else the form's for expert e."""
        up_bias = self.gate_up_bias[e] if self.gate_up_bias is not None else None
        down_bias = self.down_bias[e] if self.down_bias is not None else None
        up_kernel, down_kernel = kernels if kernels is not None else self.held.kernels_of(e)
        h = up_kernel.apply(x, gate_up, up_bias)
        return down_kernel.apply(self.act(h), down, down_bias)

    def _run_expert(self, e: int, weights, x: torch.Tensor) -> torch.Tensor:
        """apply_expert with what a WeightsOf gave: (gate_up, down) or a StandIn."""
        if isinstance(weights, StandIn):
            return self.apply_expert(e, weights.gate_up, weights.down, x, weights.kernels)
        return self.apply_expert(e, *weights, x)

    def forward(self, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        """x [T, D] → Σ_k topk_weights[t, k] · expert_{topk_ids[t, k]}(x[t]), [T, D]."""
        return self.held.apply(self, x, decision)

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
        if self._stacks_grouped(x) and weights == self.form.weights:  # the resident stacks, not a store's
            return self._grouped_stacks(x, decision)
        return self._grouped_loop(x, decision, weights)

    def _stacks_grouped(self, x: torch.Tensor) -> bool:
        """Whether the many-token forward can run as two grouped GEMMs over the resident stacks: the
        Hub layout (a compiled engine's, --kernels reference) on CPU in fp32 or bf16 (where torch's
        grouped GEMM is the per-expert one), every expert alike, no biases."""
        return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and type(self.form) is Stacks and self.kernels == (PLAIN, PLAIN)
                and self.gate_up_bias is None and self.down_bias is None and not self.weigh_input
                and self._rows_of_16_bytes(x.element_size()))

    def _rows_of_16_bytes(self, itemsize: int) -> bool:
        """torch's grouped GEMM refuses operands whose row stride is not a multiple of 16 bytes: the
        hidden size D and the width F (2F the fused gate/up) at this dtype (the bundled model's F = 52
        in bf16 is 104 bytes: the loop runs it)."""
        gate_up, down = self.form.stacks  # [E, 2F, D], [E, D, F]
        return all(n * itemsize % 16 == 0 for n in (gate_up.shape[-1], gate_up.shape[-2], down.shape[-1]))

    def _grouped_stacks(self, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
        """_grouped_loop as a handful of ops instead of a handful per expert (a prompt's tokens reach
        most experts, and on a busy CPU each op's thread hand-off costs more than its work), bit
        for bit: the same per-expert GEMMs (torch_private.grouped_mm), and each token's K outputs
        added in ascending expert order, the order of the loop's one index_add_ per expert."""
        t, top_k = decision.topk_ids.shape
        ids, pick = decision.topk_ids.sort(dim=1, stable=True)  # [T, K] each token's choices by expert
        flat = ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        ends = torch.bincount(flat, minlength=self.num_experts).cumsum(0).to(torch.int32)  # [E]
        gate_up, down = self.form.stacks
        h = grouped_mm(x[order // top_k], gate_up.transpose(1, 2), ends)  # [T*K, 2F]
        y = grouped_mm(self.act(h), down.transpose(1, 2), ends)  # [T*K, D]
        scale = decision.topk_weights.gather(1, pick).reshape(-1)[order]  # [T*K]
        y = (y * scale[:, None]).to(x.dtype)
        mine = torch.empty_like(y)
        mine[order] = y  # back to token-major: row t*K + k is token t's k-th expert by id
        mine = mine.view(t, top_k, -1)  # [T, K, D]
        out = mine[:, 0].clone()
        for k in range(1, top_k):
            out += mine[:, k]
        return out

    def _grouped_loop(self, x: torch.Tensor, decision: RoutingDecision, weights: WeightsOf) -> torch.Tensor:
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
        for x [B, D], as the form runs it (read in place from stacks where it holds them)."""
        return self.held.decode(self, x, decision)

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
