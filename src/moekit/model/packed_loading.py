"""Routed experts loaded straight from a quantized checkpoint's bytes, kept packed (moekit.model.packed).

The loader (moekit.model.loading) asks `kept_experts` for each MoE block of a quantized checkpoint
(moekit.weights.quantized). Two published layouts stay packed:

  gpt_oss MXFP4   experts.gate_up_proj_blocks [E, 2F, D/32, 16] (rows gate, up, gate, up, ...: the
                  bf16 tensor's interleaved columns, as rows) and down_proj_blocks [E, D, F/32, 16];
                  expert j's gate_up is its even rows then its odd rows, down is as stored.
  per-expert FP8  experts.{j}.gate_proj / up_proj / down_proj .weight [out, in] + weight_scale_inv
                  (DeepSeek-V3, Kimi-K2); gate_up is gate's rows then up's.

Any other layout of quantized experts is dequantized at load like any other tensor. Experts are
filled one layer at a time, each expert's bytes copied once out of the memory map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moekit.errors import CheckpointError
from moekit.model import packed as kernels
from moekit.model.hub_names import HubNames
from moekit.model.linear import MXFP4, fp8_kernel, fp8_kernel_for, mxfp4_kernel_for


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


def kept_experts(ckpt, block: str, experts, names: HubNames) -> Optional[KeptExperts]:
    """How `experts` (a RoutedExperts, not yet filled) loads packed from `ckpt`, or None where the
    block's experts are not stored in a layout kept packed."""
    e, rows, d = experts.gate_up.shape
    f = experts.down.shape[2]
    gated = rows == 2 * f
    wanted = [n for n in expert_weight_names(block, e, names) if gated or f".{names.expert_gate}." not in n]
    stored = [ckpt.packed(n) for n in wanted]
    if all(p is None for p in stored):
        return None
    if any(p is None for p in stored):
        missing = wanted[[p is None for p in stored].index(True)]
        raise CheckpointError(f"{ckpt.folder}: {missing} is not quantized while other experts of {block} are")
    device = experts.gate_up.device
    method = stored[0].method
    if names.experts == "stacked_interleaved" and method == "mxfp4":
        gate_up, down = wanted
        _expect(ckpt.folder, gate_up, stored[0].shape, (e, d, rows))
        _expect(ckpt.folder, down, stored[1].shape, (e, f, d))

        dtype = experts.gate_up.dtype  # the engine's activations, which the kernel choice is measured with

        def fill_mxfp4(ckpt) -> None:
            blocks, scales = ckpt.read(gate_up)  # [E, 2F, D/32, 16], [E, 2F, D/32]
            order = torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2)))  # gate rows, then up
            up = [kernels.mxfp4_rows(blocks[j, order], scales[j, order]).to(device) for j in range(e)]
            blocks, scales = ckpt.read(down)  # [E, D, F/32, 16], [E, D, F/32]
            dn = [kernels.mxfp4_rows(blocks[j], scales[j]).to(device) for j in range(e)]
            chosen = (MXFP4, MXFP4) if device.type != "cpu" else (
                mxfp4_kernel_for(d, rows, dtype), mxfp4_kernel_for(f, d, dtype))
            experts.keep_packed(chosen, up, dn)

        return KeptExperts(method, tuple(wanted), fill_mxfp4)
    if names.experts == "per_expert" and method == "fp8":
        for name, p in zip(wanted, stored):
            is_down = name.endswith(f".{names.expert_down}.weight")
            _expect(ckpt.folder, name, p.shape, (d, f) if is_down else (f, d))
        block_size = stored[0].block
        dtype = experts.gate_up.dtype  # the engine's activations, which the kernel choice is measured with
        if device.type != "cpu":
            kernels_used = (fp8_kernel(block_size[1]), fp8_kernel(block_size[1]))
        else:
            kernels_used = (fp8_kernel_for(d, rows, dtype, block_size[1]), fp8_kernel_for(f, d, dtype, block_size[1]))

        def fill_fp8(ckpt) -> None:
            def rows_of(name: str) -> torch.Tensor:
                return kernels.fp8_rows(*ckpt.read(name), block_size)  # [out, in + 4·nbc]

            up, dn = [], []
            for j in range(e):
                prefix = f"{block}.experts.{j}."
                kinds = (names.expert_gate, names.expert_up) if gated else (names.expert_up,)
                up.append(torch.cat([rows_of(f"{prefix}{k}.weight") for k in kinds]).to(device))
                dn.append(rows_of(f"{prefix}{names.expert_down}.weight").to(device))
            experts.keep_packed(kernels_used, up, dn)

        return KeptExperts(method, tuple(wanted), fill_fp8)
    return None


def keep_packed_experts(planner, decoder, ckpt) -> list[KeptExperts]:
    """For a quantized checkpoint: take the routed experts stored in a kept-packed layout out of the
    loader's plan (their weights are filled by the returned KeptExperts instead, after the other
    pieces); refuse them under an expert store, which pages only full-precision experts so far."""
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
            method = packed_method(ckpt.packed, block, ex.num_experts, names)
            if method is not None:
                raise CheckpointError(f"{ckpt.folder}: {method.upper()} experts are not paged by the expert store yet "
                                      "(run without --expert-memory)")
            continue
        k = kept_experts(ckpt, block, ex, names)
        if k is None:
            continue
        targets = {f"layers.{i}.ffn.experts.gate_up", f"layers.{i}.ffn.experts.down"}
        planner.pieces[:] = [p for p in planner.pieces if p.target not in targets]
        planner.external.update(k.names)
        kept.append(k)
    return kept
