"""Routed experts loaded straight from a quantized checkpoint's bytes, kept packed (moekit.ops.packed_layout).

The loader (moekit.model.loading) asks `kept_experts` for each MoE block of a quantized checkpoint
(moekit.weights.quantized). Two published layouts stay packed:

  gpt_oss MXFP4   experts.gate_up_proj_blocks [E, 2F, D/32, 16] (rows gate, up, gate, up, ...: the
                  bf16 tensor's interleaved columns, as rows) and down_proj_blocks [E, D, F/32, 16];
                  expert j's gate_up is its even rows then its odd rows, down is as stored.
  per-expert FP8  experts.{j}.gate_proj / up_proj / down_proj .weight [out, in] + weight_scale_inv
                  (DeepSeek-V3, Kimi-K2); gate_up is gate's rows then up's.

Any other layout of quantized experts is dequantized at load like any other tensor. Experts are
filled one layer at a time, each expert's bytes copied once out of the memory map.

Under an expert store (`--expert-memory`) the same two layouts are paged packed: the loader only
records each MoE block's PackedFormat (method, FP8 block, the kernels chosen here for a resident
load of this shape), and the store reads one expert's published bytes into the same prepared rows
(`mxfp4_expert`, moekit.ops.packed_layout.fp8_rows), so paged tokens are the resident packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moekit.errors import CheckpointError
from moekit.ops import packed_layout as kernels
from moekit.weights.hub_names import HubNames
from moekit.model.linear import MXFP4, fp8_kernel, fp8_kernel_for, mxfp4_kernel_for


@dataclass(frozen=True)
class PackedFormat:
    """How a block's experts are kept packed: what an expert store pages them with."""

    method: str  # "mxfp4" | "fp8"
    block: tuple[int, int]  # fp8: weight_block_size; mxfp4: one row × 32
    kernels: tuple  # (gate_up's, down's) moekit.model.linear kernels


@dataclass(frozen=True)
class KeptExperts:
    method: str  # "mxfp4" | "fp8"
    names: tuple[str, ...]  # the tensors (as the view names them) this reads instead of the pieces
    fill: Callable[[object], None]  # (the quantized checkpoint) → the experts' weights set, packed


def expert_weight_names(block: str, num_experts: int, names: HubNames) -> list[str]:
    """The routed experts' weight tensors of an MoE block, as a bf16 checkpoint names them."""
    if names.experts == "per_expert":
        kinds = (names.expert_gate, names.expert_up, names.expert_down)
        return [f"{block}.experts.{j}.{k}.weight" for j in range(num_experts) for k in kinds]
    return [f"{block}.{names.stacked_gate_up}", f"{block}.{names.stacked_down}"]


def packed_method(packed, block: str, num_experts: int, names: HubNames) -> Optional[str]:
    """The method the block's expert weights are stored in, None when they are not quantized."""
    found = {p.method for n in expert_weight_names(block, num_experts, names) if (p := packed(n)) is not None}
    return next(iter(found)) if found else None


def _expect(folder, name: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"{folder}: tensor {name} has shape {list(got)}, expected {list(want)}")


def mxfp4_expert(up_blocks: torch.Tensor, up_scales: torch.Tensor, down_blocks: torch.Tensor,
                 down_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One gpt_oss expert's stored (blocks [R, G, 16], scales [R, G]) pairs → its prepared
    (gate_up [2F, G·17]: the even (gate) rows, then the odd (up) rows; down [D, G'·17] as stored)."""
    rows = up_blocks.shape[0]
    order = torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2)))  # gate rows, then up
    return kernels.mxfp4_rows(up_blocks[order], up_scales[order]), kernels.mxfp4_rows(down_blocks, down_scales)


def mxfp4_experts(ckpt, gate_up: str, down: str, e: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every expert's prepared (gate_up, down) rows: a GGUF's read one expert at a time straight from
    its ggml blocks (moekit.weights.gguf_mxfp4), the Hub's from its stored blocks and scales."""
    from_file = getattr(ckpt, "mxfp4_expert_rows", None)
    if from_file is not None:
        return from_file(gate_up, down)
    up_blocks, up_scales = ckpt.read(gate_up)  # [E, 2F, D/32, 16], [E, 2F, D/32]
    down_blocks, down_scales = ckpt.read(down)  # [E, D, F/32, 16], [E, D, F/32]
    return [mxfp4_expert(up_blocks[j], up_scales[j], down_blocks[j], down_scales[j]) for j in range(e)]


def packed_kernels(method: str, block_in: int, shape: tuple[int, int, int], dtype: torch.dtype, device) -> tuple:
    """(gate_up's, down's) kernel for experts of shape (rows, D, F) kept packed, measured on CPU for
    the engine's activation dtype (moekit.ops.packed_operator_wins, measured once per machine and kept)."""
    rows, d, f = shape
    if method == "mxfp4":
        if device.type != "cpu":
            return MXFP4, MXFP4
        return mxfp4_kernel_for(d, rows, dtype), mxfp4_kernel_for(f, d, dtype)
    if device.type != "cpu":
        return fp8_kernel(block_in), fp8_kernel(block_in)
    return fp8_kernel_for(d, rows, dtype, block_in), fp8_kernel_for(f, d, dtype, block_in)


def _gated(experts) -> bool:
    return experts.weight_shapes[0][0] == 2 * experts.in_features[1]


def _wanted(block: str, experts, names: HubNames) -> list[str]:
    """The expert weight tensors the block's experts are made of (no gate for ungated experts)."""
    gated = _gated(experts)
    return [n for n in expert_weight_names(block, experts.num_experts, names) if gated or f".{names.expert_gate}." not in n]


def packed_format(ckpt, block: str, experts, names: HubNames, dtype: torch.dtype, device) -> Optional[PackedFormat]:
    """How the block's experts stay packed, their stored shapes checked; None where they are not
    stored in a layout kept packed. dtype, device: the engine's (the kernels are chosen for them)."""
    e = experts.num_experts
    (rows, d), f = experts.weight_shapes[0], experts.in_features[1]
    wanted = _wanted(block, experts, names)
    stored = [ckpt.packed(n) for n in wanted]
    if all(p is None for p in stored):
        return None
    if any(p is None for p in stored):
        missing = wanted[[p is None for p in stored].index(True)]
        raise CheckpointError(f"{ckpt.folder}: {missing} is not quantized while other experts of {block} are")
    method = stored[0].method
    if names.experts == "stacked_interleaved" and method == "mxfp4":
        _expect(ckpt.folder, wanted[0], stored[0].shape, (e, d, rows))
        _expect(ckpt.folder, wanted[1], stored[1].shape, (e, f, d))
    elif names.experts == "per_expert" and method == "fp8":
        for name, p in zip(wanted, stored):
            is_down = name.endswith(f".{names.expert_down}.weight")
            _expect(ckpt.folder, name, p.shape, (d, f) if is_down else (f, d))
    else:
        return None
    block_size = stored[0].block
    return PackedFormat(method, block_size, packed_kernels(method, block_size[1], (rows, d, f), dtype, device))


def kept_experts(ckpt, block: str, experts, names: HubNames) -> Optional[KeptExperts]:
    """How `experts` (a RoutedExperts, not yet filled) loads packed from `ckpt`, or None where the
    block's experts are not stored in a layout kept packed."""
    device = experts.gate_up.device
    dtype = experts.gate_up.dtype  # the engine's activations, which the kernel choice is measured with
    fmt = packed_format(ckpt, block, experts, names, dtype, device)
    if fmt is None:
        return None
    e, gated = experts.num_experts, _gated(experts)
    wanted = _wanted(block, experts, names)
    if fmt.method == "mxfp4":
        gate_up, down = wanted

        def fill_mxfp4(ckpt) -> None:
            pairs = mxfp4_experts(ckpt, gate_up, down, e)
            experts.keep_packed(fmt.kernels, [up.to(device) for up, _ in pairs], [dn.to(device) for _, dn in pairs], fmt)

        return KeptExperts(fmt.method, tuple(wanted), fill_mxfp4)

    def fill_fp8(ckpt) -> None:
        def rows_of(name: str) -> torch.Tensor:
            return kernels.fp8_rows(*ckpt.read(name), fmt.block)  # [out, in + 4·nbc]

        up, dn = [], []
        for j in range(e):
            prefix = f"{block}.experts.{j}."
            kinds = (names.expert_gate, names.expert_up) if gated else (names.expert_up,)
            up.append(torch.cat([rows_of(f"{prefix}{k}.weight") for k in kinds]).to(device))
            dn.append(rows_of(f"{prefix}{names.expert_down}.weight").to(device))
        experts.keep_packed(fmt.kernels, up, dn, fmt)

    return KeptExperts(fmt.method, tuple(wanted), fill_fp8)


def keep_packed_experts(planner, decoder, ckpt) -> list[KeptExperts]:
    """For a quantized checkpoint: take the routed experts stored in a kept-packed layout out of the
    loader's plan (their weights are filled by the returned KeptExperts instead, after the other
    pieces). Offloaded experts (an expert store's) are not read here: each block records its
    PackedFormat for the store; quantized experts of any other layout are refused there."""
    if not hasattr(ckpt, "packed"):
        return []
    from moekit.model.moe import MoE

    names = planner.names
    kept = []
    for i, layer in enumerate(decoder.layers):
        if not isinstance(layer.ffn, MoE):
            continue
        ex = layer.ffn.experts
        block = f"{names.prefix}.{names.layers}.{i}.{names.moe}"
        if ex.offloaded:
            fmt = packed_format(ckpt, block, ex, names, decoder.dtype, decoder.device)
            ex.offload(packed=fmt)  # the store's form, which attach_store completes
            method = packed_method(ckpt.packed, block, ex.num_experts, names)
            if method is not None and fmt is None:
                raise CheckpointError(f"{ckpt.folder}: {method.upper()} experts of {decoder.spec.model_type} are not "
                                      "paged by the expert store (run without --expert-memory)")
            continue
        k = kept_experts(ckpt, block, ex, names)
        if k is None:
            continue
        targets = {f"layers.{i}.ffn.experts.gate_up", f"layers.{i}.ffn.experts.down"}
        planner.pieces[:] = [p for p in planner.pieces if p.target not in targets]
        planner.external.update(k.names)
        kept.append(k)
    return kept
