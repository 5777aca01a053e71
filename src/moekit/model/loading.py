"""Fill a Decoder from a Hub checkpoint: every parameter from named tensors, every tensor accounted for.

`plan(decoder)` lists Pieces: which Hub tensors (with the shape each must have) make one of our
parameters and how they are laid into it (copy, rows stacked, gpt_oss's interleaved halves). Loading
checks presence and shape of every source first, then copies in place (casting to the model dtype),
then refuses a checkpoint holding tensors nothing used, unless they are known to be unused
(DeepSeek's multi-token-prediction layers past the last layer, a tied head, rotary caches).
Nothing is held twice for long: a GGUF's large tensors are read a few rows at a time, and with
`--weights int8` each projection becomes q8_0 blocks as it is read (`load_into`), so a model whose
experts are paged loads in about the memory it then runs in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from moekit.errors import CheckpointError
from moekit.model.attention import Attention
from moekit.weights.hub_names import HubNames, hub_names
from moekit.model.mlp import MLP
from moekit.model.moe import MoE
from moekit.model.norms import LayerNorm
from moekit.model.packed_loading import keep_packed_experts
from moekit.model.rope import pairs_to_halves

Shape = tuple[int, ...]
UNMAP_EVERY = 4 * 1024 * 1024  # bytes read through the checkpoint's mmaps before they are dropped


@dataclass(frozen=True)
class Piece:
    target: str  # our parameter name
    sources: tuple[tuple[str, Shape], ...]  # Hub tensor name and the shape it must have
    fill: Callable[[Tensor, list[Tensor]], None]  # lays the sources (in order) into the target


def _copy(target: Tensor, src: list[Tensor]) -> None:
    target.copy_(src[0])


def _rows(target: Tensor, src: list[Tensor]) -> None:
    """Sources stacked along dim 0 (q, k, v into qkv; gate, up into gate_up)."""
    begin = 0
    for s in src:
        target[begin : begin + s.shape[0]].copy_(s)
        begin += s.shape[0]


def _per_expert(per: int) -> Callable[[Tensor, list[Tensor]], None]:
    """Sources in groups of `per` per expert (gate, up or down alone), stacked into target[j]."""

    def fill(target: Tensor, src: list[Tensor]) -> None:
        for j in range(target.shape[0]):
            _rows(target[j], src[j * per : (j + 1) * per])

    return fill


def _deinterleave_gate_up(target: Tensor, src: list[Tensor]) -> None:
    """gpt_oss [E, D, 2F] with gate at even, up at odd columns → ours [E, 2F, D], gate rows first."""
    f = target.shape[1] // 2
    target[:, :f].copy_(src[0][:, :, 0::2].transpose(1, 2))
    target[:, f:].copy_(src[0][:, :, 1::2].transpose(1, 2))


def _deinterleave_bias(target: Tensor, src: list[Tensor]) -> None:
    f = target.shape[1] // 2
    target[:, :f].copy_(src[0][:, 0::2])
    target[:, f:].copy_(src[0][:, 1::2])


def _transposed(target: Tensor, src: list[Tensor]) -> None:
    target.copy_(src[0].transpose(1, 2))


def _qk_pairs_to_halves(heads: int, kv_heads: int, head_dim: int) -> Callable[[Tensor, list[Tensor]], None]:
    """q, k, v rows stacked (as _rows), then each q and k head's pair-wise dims reordered into halves:
    llama4's complex rotation becomes the rolled one (moekit.model.rope.pairs_to_halves)."""

    def fill(target: Tensor, src: list[Tensor]) -> None:
        _rows(target, src)
        q, k = heads * head_dim, kv_heads * head_dim
        target[:q].copy_(pairs_to_halves(target[:q].clone(), heads, head_dim))
        target[q : q + k].copy_(pairs_to_halves(target[q : q + k].clone(), kv_heads, head_dim))

    return fill


def _expert_rows(target: Tensor, src: list[Tensor]) -> None:
    """DBRX's [E*F, D] gate and up → ours [E, 2F, D]: expert j's F rows of each, gate first."""
    e, _, d = target.shape
    begin = 0
    for s in src:
        f = s.shape[0] // e
        target[:, begin : begin + f].copy_(s.view(e, f, d))
        begin += f


def _expert_rows_transposed(target: Tensor, src: list[Tensor]) -> None:
    """DBRX's w2 [E*F, D] (applied as x @ W) → ours [E, D, F]."""
    e, d, f = target.shape
    target.copy_(src[0].view(e, f, d).transpose(1, 2))


class _Planner:
    def __init__(self, decoder):
        self.names = hub_names(decoder.spec.model_type)
        self.pairs = decoder.spec.rope.interleaved  # llama4: q/k rows reordered for the rolled rotation
        self.params = dict(decoder.named_parameters())
        self.pieces: list[Piece] = []
        self.external: set[str] = set()  # Hub tensors an expert store reads instead of us

    def shape(self, target: str) -> Shape:
        return tuple(self.params[target].shape)

    def copy(self, target: str, source: str) -> None:
        self.pieces.append(Piece(target, ((source, self.shape(target)),), _copy))

    def rows(self, target: str, sources: list[str], widths: list[int]) -> None:
        rest = self.shape(target)[1:]
        self.pieces.append(Piece(target, tuple((s, (w, *rest)) for s, w in zip(sources, widths)), _rows))

    def add(self, target: str, sources: list[tuple[str, Shape]], fill) -> None:
        self.pieces.append(Piece(target, tuple(sources), fill))

    def norm(self, ours: str, hub: str, module) -> None:
        self.copy(f"{ours}.weight", f"{hub}.weight")
        if isinstance(module, LayerNorm) and module.bias is not None:
            self.copy(f"{ours}.bias", f"{hub}.bias")

    def attention(self, ours: str, hub: str, attn) -> None:
        if not isinstance(attn, Attention):  # MLA and any other mixer keep the Hub's own names
            for name, _ in attn.named_parameters():
                self.copy(f"{ours}.{name}", f"{hub}.{name}")
            return
        names = self.names
        projections = [f"{hub}.{names.fused_qkv}"] if names.fused_qkv else [f"{hub}.{p}_proj" for p in "qkv"]
        widths = [sum(attn.split)] if names.fused_qkv else list(attn.split)
        if self.pairs and attn.spec.use_rope:
            fill = _qk_pairs_to_halves(attn.heads, attn.kv_heads, attn.head_dim)
            for kind in ("weight", "bias") if attn.qkv.bias is not None else ("weight",):
                rest = self.shape(f"{ours}.qkv.{kind}")[1:]
                self.add(f"{ours}.qkv.{kind}", [(f"{p}.{kind}", (w, *rest)) for p, w in zip(projections, widths)], fill)
        else:
            self.rows(f"{ours}.qkv.weight", [f"{p}.weight" for p in projections], widths)
            if attn.qkv.bias is not None:
                self.rows(f"{ours}.qkv.bias", [f"{p}.bias" for p in projections], widths)
        self.copy(f"{ours}.o_proj.weight", f"{hub}.{names.o_proj}.weight")
        if attn.o_proj.bias is not None:
            self.copy(f"{ours}.o_proj.bias", f"{hub}.{names.o_proj}.bias")
        if hasattr(attn, "q_norm"):
            self.copy(f"{ours}.q_norm.weight", f"{hub}.q_norm.weight")
            self.copy(f"{ours}.k_norm.weight", f"{hub}.k_norm.weight")
        if attn.sinks is not None:
            self.copy(f"{ours}.sinks", f"{hub}.sinks")

    def mlp(self, ours: str, hub: str, mlp: MLP) -> None:
        gated = mlp.gate_up.weight.shape[0] == 2 * mlp.width
        parts = [f"{hub}.gate_proj", f"{hub}.up_proj"] if gated else [f"{hub}.up_proj"]
        widths = [mlp.width] * len(parts)
        self.rows(f"{ours}.gate_up.weight", [f"{p}.weight" for p in parts], widths)
        self.copy(f"{ours}.down.weight", f"{hub}.down_proj.weight")
        if mlp.gate_up.bias is not None:
            self.rows(f"{ours}.gate_up.bias", [f"{p}.bias" for p in parts], widths)
            self.copy(f"{ours}.down.bias", f"{hub}.down_proj.bias")

    def moe(self, ours: str, hub: str, moe: MoE, names: HubNames) -> None:
        block = f"{hub}.{names.moe}"
        self.copy(f"{ours}.router.weight", f"{block}.{names.router}.weight")
        if moe.router.bias is not None:
            self.copy(f"{ours}.router.bias", f"{block}.{names.router}.bias")
        if moe.router.selection_bias is not None:
            self.copy(f"{ours}.router.selection_bias", f"{block}.{names.selection_bias}")
        if moe.experts.offloaded:
            self.offloaded_experts(f"{ours}.experts", block, moe, names)
        else:
            self.experts(f"{ours}.experts", block, moe, names)
        if moe.shared is not None:
            self.mlp(f"{ours}.shared", f"{block}.{names.shared}", moe.shared)
        if moe.shared_gate is not None:
            self.copy(f"{ours}.shared_gate.weight", f"{block}.{names.shared_gate}.weight")

    def experts(self, ours: str, block: str, moe: MoE, names: HubNames) -> None:
        ex = moe.experts
        e, rows, d = ex.gate_up.shape
        f = ex.down.shape[2]
        if names.experts == "stacked":
            self.copy(f"{ours}.gate_up", f"{block}.{names.stacked_gate_up}")
            self.copy(f"{ours}.down", f"{block}.{names.stacked_down}")
        elif names.experts == "stacked_transposed":
            self.add(f"{ours}.gate_up", [(f"{block}.{names.stacked_gate_up}", (e, d, rows))], _transposed)
            self.add(f"{ours}.down", [(f"{block}.{names.stacked_down}", (e, f, d))], _transposed)
        elif names.experts == "stacked_rows":
            gated = rows == 2 * f
            kinds = [names.expert_gate, names.expert_up] if gated else [names.expert_up]
            self.add(f"{ours}.gate_up", [(f"{block}.{k}", (e * f, d)) for k in kinds], _expert_rows)
            self.add(f"{ours}.down", [(f"{block}.{names.expert_down}", (e * f, d))], _expert_rows_transposed)
        elif names.experts == "stacked_interleaved":
            gate_up, down = f"{block}.{names.stacked_gate_up}", f"{block}.{names.stacked_down}"
            self.add(f"{ours}.gate_up", [(gate_up, (e, d, rows))], _deinterleave_gate_up)
            self.add(f"{ours}.down", [(down, (e, f, d))], _transposed)
            if ex.gate_up_bias is not None:
                self.add(f"{ours}.gate_up_bias", [(f"{gate_up}_bias", (e, rows))], _deinterleave_bias)
                self.copy(f"{ours}.down_bias", f"{down}_bias")
        else:
            gated = rows == 2 * f
            kinds = [names.expert_gate, names.expert_up] if gated else [names.expert_up]
            up = [(f"{block}.experts.{j}.{k}.weight", (f, d)) for j in range(e) for k in kinds]
            self.add(f"{ours}.gate_up", up, _per_expert(len(kinds)))
            down = [(f"{block}.experts.{j}.{names.expert_down}.weight", (d, f)) for j in range(e)]
            self.add(f"{ours}.down", down, _per_expert(1))
            if ex.gate_up_bias is not None:
                up_b = [(f"{block}.experts.{j}.{k}.bias", (f,)) for j in range(e) for k in kinds]
                self.add(f"{ours}.gate_up_bias", up_b, _per_expert(len(kinds)))
                down_b = [(f"{block}.experts.{j}.{names.expert_down}.bias", (d,)) for j in range(e)]
                self.add(f"{ours}.down_bias", down_b, _per_expert(1))


    def offloaded_experts(self, ours: str, block: str, moe: MoE, names: HubNames) -> None:
        """Only the biases are ours; the weight tensors are the store's and are not read here."""
        ex = moe.experts
        if names.experts == "stacked_rows":  # dbrx: [E·F, D] gate, up and down rows, no expert biases
            self.external.update(f"{block}.{k}" for k in (names.expert_gate, names.expert_up, names.expert_down))
            return
        if names.experts == "per_expert":
            kinds = [names.expert_gate, names.expert_up, names.expert_down]
            self.external.update(f"{block}.experts.{j}.{k}.weight" for j in range(ex.num_experts) for k in kinds)
            if ex.gate_up_bias is not None:
                raise CheckpointError(f"{ours}: per-expert biases with an expert store are not supported")
            return
        gate_up, down = f"{block}.{names.stacked_gate_up}", f"{block}.{names.stacked_down}"
        self.external.update((gate_up, down))
        if ex.gate_up_bias is not None:
            if names.experts == "stacked_interleaved":
                rows = ex.gate_up_bias.shape[1]
                self.add(f"{ours}.gate_up_bias", [(f"{gate_up}_bias", (ex.num_experts, rows))], _deinterleave_bias)
                self.copy(f"{ours}.down_bias", f"{down}_bias")
            else:
                raise CheckpointError(f"{ours}: stacked expert biases of this layout are not supported with an expert store")


def plan(decoder) -> list[Piece]:
    """Every parameter of `decoder` and the Hub tensors that make it."""
    return _planned(decoder).pieces


def _planned(decoder) -> _Planner:
    p = _Planner(decoder)
    names = p.names
    p.copy("embed.weight", f"{names.prefix}.{names.embed}.weight")
    p.norm("norm", f"{names.prefix}.{names.final_norm}", decoder.norm)
    if decoder.lm_head is not None:
        p.copy("lm_head.weight", f"{names.lm_head}.weight")
        if decoder.lm_head.bias is not None:
            p.copy("lm_head.bias", f"{names.lm_head}.bias")
    if decoder.head_bias is not None:
        p.copy("head_bias", f"{names.lm_head}.bias")
    for i, block in enumerate(decoder.layers):
        ours, hub = f"layers.{i}", f"{names.prefix}.{names.layers}.{i}"
        p.norm(f"{ours}.input_norm", f"{hub}.{names.input_norm}", block.input_norm)
        p.norm(f"{ours}.post_norm", f"{hub}.{names.post_norm}", block.post_norm)
        p.attention(f"{ours}.attn", f"{hub}.{names.attention}", block.attn)
        if isinstance(block.ffn, MoE):
            p.moe(f"{ours}.ffn", hub, block.ffn, names)
        else:
            p.mlp(f"{ours}.ffn", f"{hub}.{names.dense_mlp}", block.ffn)
    left = set(p.params) - {piece.target for piece in p.pieces}
    assert not left, f"parameters with no Hub source: {sorted(left)}"
    return p


def _ignored(name: str, decoder) -> bool:
    """Tensors a checkpoint may hold that this decoder rightly leaves unused."""
    names = hub_names(decoder.spec.model_type)
    layer = re.match(rf"{re.escape(names.prefix)}\.{re.escape(names.layers)}\.(\d+)\.", name)
    if layer and int(layer.group(1)) >= decoder.spec.num_layers:
        return True  # DeepSeek's multi-token-prediction layers follow the decoder's last layer
    if name == f"{names.lm_head}.weight" and decoder.lm_head is None:
        return True  # a tied head saved anyway
    if name.startswith(names.unused_prefixes):
        return True  # another modality's tower (llama4's vision model)
    return name.endswith("rotary_emb.inv_freq")


def load_into(decoder, ckpt, int8: bool = False) -> None:
    """Fill every parameter of `decoder` from `ckpt`. int8: each projection `--weights int8` makes
    q8_0 blocks (moekit.model.int8.quantized_linear; not MLA's, which prepare fuses first) is made so
    as it is read, one at a time, so the dense weights are never all held at the dtype before
    quantize_decoder: a Q8_0 GGUF's blocks are taken as stored, any other weight is quantized from
    the dtype's values by rows, as quantize_decoder would have (tests/model/test_streamed_load.py)."""
    planner = _planned(decoder)
    kept = keep_packed_experts(planner, decoder, ckpt)  # MXFP4 / FP8 experts stay packed; [] otherwise
    pieces, external = planner.pieces, planner.external
    present = set(ckpt.files)
    for piece in pieces:
        for name, shape in piece.sources:
            if name not in present:
                raise CheckpointError(f"{ckpt.folder}: tensor {name} is missing (needed for {piece.target})")
            got = ckpt.shape(name)
            if got != shape:
                raise CheckpointError(f"{ckpt.folder}: tensor {name} has shape {list(got)}, expected {list(shape)}")
    used = {name for piece in pieces for name, _ in piece.sources} | external
    unused = sorted(n for n in present - used if not _ignored(n, decoder))
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise CheckpointError(
            f"{ckpt.folder}: unexpected tensor {unused[0]}{more}; is this the model the config describes?"
        )
    params = dict(decoder.named_parameters())
    linears = _int8_linears(decoder) if int8 else {}
    reads = _Reads(ckpt)
    with torch.no_grad():
        for piece in pieces:
            linear = linears.get(piece.target)
            if linear is None:
                _fill(piece, params[piece.target], ckpt, reads)
            else:
                _fill_int8(piece, linear, ckpt, reads)
        for k in kept:  # one MoE layer at a time, then its pages are unmapped
            k.fill(ckpt)
            ckpt.close()


CHUNK = 32 * 1024 * 1024  # bytes of fp32 rows a streamed tensor is read or quantized in at once


@dataclass
class _Reads:
    """Bytes read through the checkpoint's mmaps since they were last dropped."""

    ckpt: object
    since: int = 0

    def add(self, nbytes: int) -> None:
        self.since += nbytes
        if self.since > UNMAP_EVERY:
            # Pages read through the memory map count as this process's RSS until unmapped:
            # without this a model's weights would be counted twice while it loads.
            self.ckpt.close()
            self.since = 0


def _chunk_rows(row: Tensor) -> int:
    """Rows of a tensor whose rows are like `row` that make one CHUNK at fp32."""
    return max(1, CHUNK // max(1, row.numel() * 4))


def _row_reader(piece: Piece, target: Tensor, ckpt):
    """A reader of the piece's rows (moekit.weights.gguf_checkpoint's row_reader) when the piece is
    one large tensor copied as it is and the checkpoint reads by rows; else None (read it whole)."""
    reader = getattr(ckpt, "row_reader", None)
    if reader is None or piece.fill is not _copy or target.dim() < 2 or target.numel() * 4 <= CHUNK:
        return None
    return reader(piece.sources[0][0])


def _fill(piece: Piece, target: Tensor, ckpt, reads: _Reads) -> None:
    """The piece's sources laid into `target` (a large GGUF tensor a CHUNK of rows at a time: its
    float32 form is never whole in memory)."""
    rows = _row_reader(piece, target, ckpt)
    if rows is not None:
        step = _chunk_rows(target[0])
        for start in range(0, target.shape[0], step):
            part = rows(start, min(start + step, target.shape[0]))
            target[start : start + part.shape[0]].copy_(part)
            reads.add(part.numel() * part.element_size())
            del part
        return
    sources = [ckpt.get(name) for name, _ in piece.sources]
    piece.fill(target, sources)
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    del sources
    reads.add(nbytes)


def _int8_linears(decoder) -> dict:
    """Weight name → its Linear, for the projections the loader quantizes as it reads them: those
    quantize_decoder would, except inside MLA (its prepare fuses and splits them at the dtype)."""
    from moekit.model.int8 import quantized_linear
    from moekit.model.mla import MLAttention

    fused = [f"{name}." for name, m in decoder.named_modules() if isinstance(m, MLAttention)]
    return {f"{name}.weight": m for name, m in decoder.named_modules()
            if quantized_linear(m) and not any(name.startswith(f) for f in fused)}


def _fill_int8(piece: Piece, linear, ckpt, reads: _Reads) -> None:
    """The piece's weight as q8_0 blocks, into `linear` (as Linear.quantize_int8 leaves it)."""
    from moekit.model.linear import int8_kernel_for

    target = linear.weight
    blocks = _stored_q8_0(piece, ckpt)
    if blocks is not None:
        reads.add(blocks.numel())
    else:
        blocks = _quantized_by_rows(piece, target, ckpt, reads)
    kernel = int8_kernel_for(target, target.dtype)  # chosen by the float weight's shape and dtype, as quantize_int8
    linear.weight = torch.nn.Parameter(blocks, requires_grad=False)  # the float weight, never filled, is freed
    linear.kernel = kernel


def _stored_q8_0(piece: Piece, ckpt):
    """The piece's weight as the checkpoint's own Q8_0 blocks, when every source is stored so
    (a GGUF) and the piece only stacks rows; else None."""
    reader = getattr(ckpt, "q8_0_blocks", None)
    if reader is None or piece.fill not in (_copy, _rows):
        return None
    parts = [reader(name) for name, _ in piece.sources]
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _quantized_by_rows(piece: Piece, target: Tensor, ckpt, reads: _Reads) -> Tensor:
    """q8_0 blocks of the piece's weight at the target's dtype, a CHUNK of rows at a time: the bytes
    quantize_q8_0 gives the whole weight (its blocks never cross a row). A large tensor a GGUF reads
    by rows is never whole at the dtype; any other is filled whole first (one tensor, freed next)."""
    from moekit.ops.q8_0 import BLOCK, BLOCK_BYTES, quantize_q8_0

    out_features, in_features = target.shape
    blocks = torch.empty(out_features, -(-in_features // BLOCK) * BLOCK_BYTES, dtype=torch.uint8)
    step = _chunk_rows(target[0])
    streamed = _row_reader(piece, target, ckpt)
    if streamed is None:
        _fill(piece, target, ckpt, reads)
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        part = target[start:stop] if streamed is None else streamed(start, stop)
        if streamed is not None:
            reads.add(part.numel() * part.element_size())
        blocks[start:stop] = quantize_q8_0(part.to(target.dtype))  # rounded to the dtype first, as the fill rounds
        del part
    return blocks
