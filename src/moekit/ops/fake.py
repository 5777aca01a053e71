"""Shape (fake) functions for every operator of one build, so that torch.compile traces through them
and calls them as extern kernels inside the compiled graph. Legend: B rows, C choices, N outputs."""

from __future__ import annotations

import torch


def _rows(x, w, grouped=False):  # [M, K] · [N, K (or nb · 34 bytes)] → [M, N]
    return x.new_empty((x.shape[0], w.shape[0]))


def _experts(x, w, ids, grouped=False):  # [B, X, K] · [E, N, ...] at ids [B, C] → [B, C, N]
    return x.new_empty((x.shape[0], ids.shape[1], w.shape[1]))


SHAPES = {
    "rows_gemv": _rows,
    "experts_gemv": _experts,
    "rows_q8": _rows,
    "experts_q8": _experts,
    "rows_argmax": lambda x: x.new_empty((x.shape[0],), dtype=torch.int64),
    "attend": lambda query, keys, values, allowed, scale: torch.empty_like(query),
    "latent_attend": lambda query, cached, visible, scale, r: query.new_empty((query.shape[0], query.shape[1], r)),
    "rows_tiles": lambda x, w: _rows(x, w),
    "experts_tiles": lambda x, w, ids: _experts(x, w, ids),
    "mxfp4_gemv": lambda x, packed: x.new_empty((x.shape[0], packed.shape[0]), dtype=torch.float32),
    "fp8_gemv": lambda x, packed, block, lut: x.new_empty((x.shape[0], packed.shape[0])),
    "experts_mxfp4": lambda x, w, ids: x.new_empty((x.shape[0], ids.shape[1], w.shape[1]), dtype=torch.float32),
    "experts_fp8": lambda x, w, ids, block: _experts(x, w, ids),
    "transpose_into": lambda src, out: None,  # writes into out, returns nothing
}


def register_fakes(namespace: str, suffix: str) -> None:
    """Register SHAPES for one build's operators (names ending in suffix)."""
    for name, shape in SHAPES.items():
        torch.library.register_fake(f"{namespace}::{name}{suffix}")(shape)
