"""torch.library.opcheck on every operator of every build: schema, fake (shape) function, dispatch
under autograd and AOT dispatch (what torch.compile relies on), on small real inputs."""

from __future__ import annotations

import pytest
import torch

from moekit.ops import to_tiles
from moekit.ops.calls import FP8_VALUES
from moekit.ops.packed_layout import fp8_prepare, mxfp4_prepare
from moekit.ops.q8_0 import quantize_q8_0


def _samples() -> dict:
    """Each operator (but bf16_tiles, which takes no tensor) → one set of arguments."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    ids = torch.tensor([[0, 2], [1, 2]])
    q8 = torch.stack([quantize_q8_0(randn(9, 70)) for _ in range(3)])  # [E, N, nb · 34]
    cache = randn(1, 2, 6, 32)
    return {
        "rows_gemv": (randn(3, 40), randn(17, 40), False),
        "experts_gemv": (randn(2, 1, 40), randn(3, 17, 40), ids, False),
        "rows_q8": (randn(2, 70), q8[0], False),
        "experts_q8": (randn(2, 2, 70), q8, ids, False),
        "rows_argmax": (randn(3, 50),),
        "transpose_into": (randn(8, 6), torch.empty(6, 8)),
        "latent_attend": (randn(1, 4, 40), randn(1, 6, 40), torch.tensor([[True, False, True, True, False, True]]), 0.5, 32),
        "attend": (randn(1, 2, 3, 32), cache, cache.clone(), torch.tensor([[True, True, False, True, True, True]]), 0.5),
        "rows_tiles": (randn(2, 64).bfloat16(), to_tiles(randn(32, 64).bfloat16())),
        "experts_tiles": (randn(2, 1, 64).bfloat16(), to_tiles(randn(3, 32, 64).bfloat16()), ids),
        "mxfp4_gemv": (randn(2, 64), mxfp4_prepare(randn(8, 64))),
        "fp8_gemv": (randn(2, 160), fp8_prepare(randn(8, 160), 128), 128, FP8_VALUES),
        "experts_mxfp4": (randn(2, 1, 64), torch.stack([mxfp4_prepare(randn(8, 64)) for _ in range(3)]), ids),
        "experts_fp8": (randn(2, 2, 160), torch.stack([fp8_prepare(randn(8, 160), 128) for _ in range(3)]), ids, 128),
    }


@pytest.mark.parametrize("name", sorted(_samples()))
def test_opcheck(ops, name):
    torch.library.opcheck(getattr(ops, name), _samples()[name])
