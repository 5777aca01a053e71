"""The tiles layout of bf16 weights that moekit::rows_tiles / experts_tiles read: each block of 16
weight rows stored as its K / 32 tiles of 16 rows x 32 inputs, one contiguous stream per block (an
AMX machine's compiled bf16 step lays its weights out so: moekit.model.linear.TILES)."""

from __future__ import annotations

import torch

TILE_ROWS, TILE_COLS = 16, 32  # a tile: 16 weight rows x 32 inputs (the C++ TILE_ROWS, TILE_COLS)


def tiles_fit(weight: torch.Tensor) -> bool:
    """Whether a Hub weight [out, in] (or a stack [E, out, in]) can be laid out in tiles: bf16, on
    the CPU, out a multiple of 16 and in of 32."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() in (2, 3)
            and weight.shape[-2] % TILE_ROWS == 0 and weight.shape[-1] % TILE_COLS == 0)


def to_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A Hub weight [.., N, K] in the tiles layout: the same shape and values, each block of 16 rows
    stored as its K / 32 tiles of 16 rows x 32 inputs."""
    *lead, n, k = weight.shape
    blocks = weight.reshape(*lead, n // TILE_ROWS, TILE_ROWS, k // TILE_COLS, TILE_COLS)
    return blocks.transpose(-3, -2).contiguous().view(weight.shape)


def from_tiles(tiled: torch.Tensor) -> torch.Tensor:
    """The Hub weight back from to_tiles' layout, exactly."""
    *lead, n, k = tiled.shape
    blocks = tiled.reshape(*lead, n // TILE_ROWS, k // TILE_COLS, TILE_ROWS, TILE_COLS)
    return blocks.transpose(-3, -2).contiguous().view(tiled.shape)
