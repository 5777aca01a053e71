"""How one MoE layer's routed experts are held: one strategy object per weight form, and how each runs.

A RoutedExperts module holds one ExpertsForm (as vLLM's FusedMoE holds one quant method: the object
that holds the weights and applies them, so the layer does not branch on mode flags):
  Stacks      resident stacks [E, out, in], the Hub layout (PLAIN, ROWS) or tiles (TILES): the decode
              step reads the chosen experts in place (moekit::experts_gemv / experts_tiles); eagerly
              only where the command loaded the operators (ROWS at batch 1, with the combine's
              floats; TILES), else the eager combine.
  Int8Stacks  resident q8_0 stacks [E, out, nb·34] (`--weights int8`), each expert's weights views
              of them: moekit::experts_q8 in the decode step.
  PerExpert   resident, each expert laid out for its eager kernel (transposed, oneDNN).
  Packed      resident stacks kept as the checkpoint publishes them (MXFP4, FP8: model.packed_loading):
              the decode step reads the chosen experts' packed rows in place (moekit::experts_mxfp4 /
              experts_fp8); eagerly, MXFP4 on the rows operator runs a prompt's experts grouped too.
  Paged       served by a store: moekit.offload's expert store, or expert parallelism's layer.
Each has `apply` (eager, any T: the module's combine, or the store's forward) and `decode` (the
T = 1 step's form, moekit.model.step_ops; the eager combine where a form has no stack to read in
place); `compiles()` says why the compiled step cannot read it (None: it can). `resident_form` is
the one function that chooses a resident form from how the weights are held.
Legend: B rows (one token each), D hidden, E experts, K chosen, F expert width.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from moekit import ops
from moekit.model import step_ops
from moekit.model.linear import MXFP4_GEMV, PLAIN, ROWS, TILES

GEMV_MISSING = "the gemv operators, which this process has not loaded (--kernels reference, or their build failed)"


@dataclass
class ExpertsForm:
    """Resident experts held as per-expert tuples (the base: what every resident form can give)."""

    kernels: tuple  # (gate_up's, down's) kernel
    gate_up: tuple = ()  # expert e's prepared gate_up is gate_up[e]: plain tuples, the hot loop's (ParameterList indexing costs µs)
    down: tuple = ()

    def kernels_of(self, e: int) -> tuple:
        return self.kernels

    def weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up, down) as this form holds them."""
        return self.gate_up[e], self.down[e]

    def replace(self, e: int, weights: tuple) -> tuple:
        """Expert e's weights ← `weights` (laid out for self.kernels); returns the ones replaced."""
        old = self.weights(e)
        self.gate_up = self.gate_up[:e] + (weights[0],) + self.gate_up[e + 1 :]
        self.down = self.down[:e] + (weights[1],) + self.down[e + 1 :]
        return old

    def apply(self, experts, x: torch.Tensor, decision) -> torch.Tensor:
        """x [T, D] → Σ_k w[t, k] · expert_{ids[t, k]}(x[t]), [T, D]: the module's combine."""
        return experts.combine(x, decision, self.weights)

    def decode(self, experts, x: torch.Tensor, decision) -> torch.Tensor:
        """The decode step's form, x [B, D] → [B, D]; here the eager combine."""
        return self.apply(experts, x, decision)

    def compiles(self) -> Optional[str]:
        return "routed experts are laid out for the eager kernels (load with compile, which keeps the Hub layout)"

    def scratch(self):
        """A context in which the decode steps run are scratch ones, their outputs discarded (the
        compiled step's warm-up): a form with state of its own (a store) leaves it untouched."""
        return nullcontext()


@dataclass
class PerExpert(ExpertsForm):
    """Resident experts each laid out for its eager kernel (moekit.model.linear.kernel_for)."""


@dataclass
class Stacks(ExpertsForm):
    """Resident stacks [E, out, in] (Hub layout or tiles) that the decode step reads in place; the
    per-expert tuples are views of them."""

    stacks: tuple = ()  # (gate_up [E, 2F, D], down [E, D, F])

    def replace(self, e: int, weights: tuple) -> tuple:
        # Written into the stacks the decode step reads in place; a copy of the old expert handed back.
        old = (self.stacks[0][e].clone(), self.stacks[1][e].clone())
        self.stacks[0][e].copy_(weights[0])
        self.stacks[1][e].copy_(weights[1])
        return old

    def decode(self, experts, x: torch.Tensor, decision) -> torch.Tensor:
        tiles = self.kernels == (TILES, TILES)
        eager = not torch.compiler.is_compiling()
        if eager and self.kernels == (ROWS, ROWS) and x.shape[0] == 1:
            return self._one_row(experts, x, decision)
        if eager and not tiles:
            # Eagerly the kernels' combine (ROWS: rows_gemv per expert), whether or not this process
            # has the operators registered (an eager step sums as its command asked); for the plain
            # kernel without them W[ids] would copy the chosen experts.
            return self.apply(experts, x, decision)
        x, ids, w = _choices(experts, x, decision)
        gate_up, down = self.stacks
        h = _bias(_rows(x, gate_up, ids, tiles), experts.gate_up_bias, ids)  # [B, K, 2F]
        y = _bias(_rows(experts.act(h), down, ids, tiles), experts.down_bias, ids)  # [B, K, D]
        return (y * w[..., None].to(y.dtype)).sum(1)  # [B, D]

    def _one_row(self, experts, x: torch.Tensor, decision) -> torch.Tensor:
        """The eager step of ROWS stacks at batch 1: the chosen experts read in place by
        moekit::experts_gemv (two calls a layer where the combine makes two per chosen expert), each
        product the combine's own (ROWS.apply: rows_gemv) bit for bit, the activation on each
        expert's row apart as the combine has it (on the K rows as one, torch's vector loops round
        a transcendental's elements at other places: gpt_oss's swiglu, measured), the K terms added
        as the combine adds them: the modules' forward's floats, and the expert-parallel layer's."""
        x, ids, w = _choices(experts, x, decision)
        gate_up, down = self.stacks
        h = _bias(ops.experts_gemv(x, gate_up, ids), experts.gate_up_bias, ids)  # [1, K, 2F]
        a = torch.stack([experts.act(h[:, k]) for k in range(h.shape[1])], dim=1)  # [1, K, F]
        y = _bias(ops.experts_gemv(a, down, ids), experts.down_bias, ids)  # [1, K, D]
        terms = (y * w[..., None]).to(x.dtype)  # each rounded once, as the combine's y.mul_(w)
        out = terms[:, 0]
        for k in range(1, terms.shape[1]):
            out = out + terms[:, k]  # in router order, as its out.add_
        return out

    def compiles(self) -> Optional[str]:
        return None


@dataclass
class Int8Stacks(Stacks):
    """Resident q8_0 stacks [E, out, nb·34]; expert e's blocks are views of them."""

    def decode(self, experts, x: torch.Tensor, decision) -> torch.Tensor:
        if not (step_ops.has_gemv() and all(step_ops.q8_operator(k) for k in self.kernels)):
            return self.apply(experts, x, decision)  # each expert through its int8 kernel
        x, ids, w = _choices(experts, x, decision)
        gate_up, down = self.stacks
        experts_q8, grouped = step_ops.op_for(gate_up, "experts_q8"), step_ops.grouped("q8_0")
        h = _bias(experts_q8(x, gate_up, ids, grouped), experts.gate_up_bias, ids)  # [B, K, 2F]
        y = _bias(experts_q8(experts.act(h), down, ids, grouped), experts.down_bias, ids)  # [B, K, D]
        return (y * w[..., None].to(y.dtype)).sum(1)  # [B, D]

    def compiles(self) -> Optional[str]:
        return None if step_ops.has_gemv() else "int8 experts need " + GEMV_MISSING


@dataclass
class Packed(Stacks):
    """Resident experts kept as the checkpoint publishes them (MXFP4, FP8: moekit.ops.packed_layout),
    stacked [E, out, bytes]: eagerly each chosen expert runs its kernel on its view of the stacks; the
    compiled step reads the chosen experts' packed rows in place (moekit::experts_mxfp4 / experts_fp8,
    each expert's product the rows operator's own). A hot swap writes into the stacks (Stacks.replace)."""

    format: object = None  # moekit.model.packed_loading.PackedFormat

    def apply(self, experts, x: torch.Tensor, decision) -> torch.Tensor:
        """MXFP4 experts whose kernel is the rows operator: every token's chosen experts in two calls
        of moekit::experts_mxfp4 (the rows routed to an expert multiplied against each of its weight
        rows once), summed as the combine sums them, bit for bit the combine's result; otherwise the
        combine through each expert's kernel."""
        if not self._grouped_rows(experts, x, decision):
            return experts.combine(x, decision, self.weights)
        ids, w = decision.topk_ids, decision.topk_weights  # [T, K]
        if x.shape[0] > 1:  # the combine adds a prompt's experts in ascending id, one token's in router order
            ids, pick = ids.sort(dim=1, stable=True)
            w = w.gather(1, pick)
        gate_up, down = self.stacks
        h = ops.packed_experts(x[:, None, :], gate_up, ids, experts.gate_up_bias, 0)  # [T, K, 2F]
        y = ops.packed_experts(experts.act(h), down, ids, experts.down_bias, 0)  # [T, K, D]
        parts = (y * w[..., None]).to(x.dtype)  # rounded as the combine rounds each expert's share
        out = parts[:, 0].clone()
        for k in range(1, parts.shape[1]):
            out += parts[:, k]
        return out

    def _grouped_rows(self, experts, x: torch.Tensor, decision) -> bool:
        """Whether apply's grouped form gives the combine's floats: MXFP4 on the rows operator for
        both products, which the combine takes for an expert's rows up to ops.MXFP4_ROWS."""
        if (self.format.method != "mxfp4" or x.device.type != "cpu" or experts.weigh_input
                or self.kernels != (MXFP4_GEMV, MXFP4_GEMV) or not ops.available("experts_mxfp4")):
            return False
        ids = decision.topk_ids
        return ids.shape[0] == 1 or int(torch.bincount(ids.reshape(-1)).max()) <= ops.MXFP4_ROWS

    def decode(self, experts, x: torch.Tensor, decision) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            # Eagerly apply: the grouped rows operator, or the combine through each expert's kernel
            # (the reference, or the rows operator where it measured faster for the shape).
            return self.apply(experts, x, decision)
        x, ids, w = _choices(experts, x, decision)
        gate_up, down = self.stacks
        block_in = self._block_in()
        h = ops.packed_experts(x, gate_up, ids, experts.gate_up_bias, block_in)  # [B, K, 2F]
        y = ops.packed_experts(experts.act(h), down, ids, experts.down_bias, block_in)  # [B, K, D]
        return (y * w[..., None].to(y.dtype)).sum(1)  # [B, D]

    def _block_in(self) -> int:
        """0 for MXFP4; FP8's column block width."""
        return 0 if self.format.method == "mxfp4" else int(self.format.block[1])

    def compiles(self) -> Optional[str]:
        name = ops.packed_experts_operator(self._block_in())
        if ops.available(name):
            return None
        return (f"{self.format.method.upper()} experts kept packed need moekit::{name}, which this process has not "
                "loaded (--kernels reference, or their build failed)")


@dataclass
class Paged(ExpertsForm):
    """Experts served by a store (moekit.offload.store.LayerStore, or expert parallelism's layer),
    which calls the module's combine with the weights it holds. `store` is None between a paged
    load and attach_store; `packed`: how the store keeps MXFP4/FP8 experts packed, as the loader
    recorded it."""

    store: object = None
    expert_kernels: Optional[tuple] = None  # per expert (gate_up's, down's) when a layer holds several precisions
    packed: object = None  # moekit.model.packed_loading.PackedFormat, or None

    def kernels_of(self, e: int) -> tuple:
        return self.kernels if self.expert_kernels is None else self.expert_kernels[e]

    def weights(self, e: int):
        raise RuntimeError("paged experts are the store's: it hands each one to the combine")

    def replace(self, e: int, weights: tuple) -> tuple:
        raise RuntimeError("replace_expert needs prepared, resident experts")

    def apply(self, experts, x: torch.Tensor, decision) -> torch.Tensor:
        return self.store.forward(experts, x, decision)

    def decode(self, experts, x: torch.Tensor, decision) -> torch.Tensor:
        # A store with a decode of its own runs it as one opaque op the compiled step can call (the
        # expert store's LayerStore: moekit.offload.graph_store; expert parallelism's leader:
        # moekit.dist.graph_exchange); the others combine eagerly.
        opaque = getattr(self.store, "decode", None)
        return opaque(x, decision) if opaque is not None else self.apply(experts, x, decision)

    def scratch(self):
        # The store's, where it has one: a discarded step neither reads nor counts experts.
        return getattr(self.store, "scratch", nullcontext)()

    def compiles(self) -> Optional[str]:
        if self.store is None:
            return "routed experts are paged and the expert store is not attached yet"
        if getattr(self.store, "decode", None) is None:
            return f"routed experts are served by {type(self.store).__name__}, which has no opaque op for the compiled step"
        return None


def resident_form(kernels: tuple, gate_up, down, packed=None, int8_stacks: Optional[tuple] = None) -> ExpertsForm:
    """The one place a layer's resident form is chosen, from how its weights are held: q8_0 stacks
    (int8_stacks given), packed blocks (packed: the checkpoint's format), stacks [E, out, in] in a
    layout the decode step reads in place (Hub or tiles), else one tensor per expert in its eager
    kernel's layout. gate_up / down: the stacks, or a sequence of per-expert weights."""
    views = (tuple(gate_up), tuple(down))  # per expert; of a stack, views of it
    if int8_stacks is not None:
        return Int8Stacks(kernels, *views, stacks=int8_stacks)
    if packed is not None:
        return Packed(kernels, *views, stacks=(gate_up, down), format=packed)
    if kernels in ((PLAIN, PLAIN), (ROWS, ROWS), (TILES, TILES)) and isinstance(gate_up, torch.Tensor):
        return Stacks(kernels, *views, stacks=(gate_up, down))
    return PerExpert(kernels, *views)


def _choices(experts, x: torch.Tensor, decision) -> tuple:
    """x [B, D] → (each choice's input [B, 1 or K, D], ids [B, K], the weights its output is summed with)."""
    ids, w = decision.topk_ids, decision.topk_weights  # [B, K]
    if experts.weigh_input:  # llama4: each choice's input weighed, [B, K, D], its output added as is
        return x[:, None, :] * w[..., None].to(x.dtype), ids, torch.ones_like(w)
    return x[:, None, :], ids, w  # [B, 1, D]: every choice reads the row's one input


def _rows(x: torch.Tensor, stack: torch.Tensor, ids: torch.Tensor, tiles: bool) -> torch.Tensor:
    """x [B, 1 or K, in] through the chosen experts of a stack [E, out, in] → [B, K, out], read in place."""
    if tiles:
        return ops.op("moekit", "experts_tiles")(x, stack, ids)
    if step_ops.has_gemv():
        kind = ops.kind_of(stack)
        gemv = step_ops.op_for(stack, "experts_gemv")
        return gemv(step_ops.widened(x, kind), stack, ids, step_ops.grouped(kind)).to(x.dtype)
    return (x[:, :, None, :] * stack[ids]).sum(-1)  # indirect reads when compiled, no copy


def _bias(h: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    return h if bias is None else h + bias[ids]
