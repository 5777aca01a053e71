"""Expert stacks in the tiles layout on every machine: RoutedExperts.lay_out_tiles is what an AMX
machine's compiled bf16 step does (moekit.model.compiled_step.lay_out_tiles), but the tiles
operators run on any x86 build, so the layout and a hot swap into it are checked here without AMX.

On a machine without AMX the layout is never chosen (tests/ops/test_operators.py: bf16_tiles exactly
where the CPU has them); this file forces it, so that replace_expert's write into the tiled stacks
is tested where the suite runs, not only on the AMX machines the compiled-step test needs."""

from __future__ import annotations

import torch

from moekit.engine.loader import load_engine
from moekit.model.experts import RoutedExperts
from moekit.model.linear import PLAIN, ROWS, TILES
from tests.engine.hf_tiny import write_checkpoint

# Widths in multiples of 32, which the tiles hold (moekit.ops.tiles_fit).
FITS = dict(hidden_size=64, head_dim=16)


def _logits(engine) -> torch.Tensor:
    """A 2-row prefill's logits [2, T, V]: the eager forward, which reads tiled stacks through the
    TILES kernel (a single-token step of a compile=True engine would compile the decode step)."""
    prompts = torch.tensor([[5, 9, 33, 7, 81, 14, 3, 60], [12, 40, 41, 2, 7, 8, 9, 10]])
    with torch.inference_mode():
        return engine.decoder(prompts, engine.decoder.new_cache(2, 16), torch.arange(8)[None].expand(2, 8))


def _experts(engine) -> list[RoutedExperts]:
    return [m for m in engine.decoder.modules() if isinstance(m, RoutedExperts)]


def test_a_hot_swap_into_tiled_stacks_is_the_hub_layouts(tmp_path):
    folder = write_checkpoint("qwen3_moe", tmp_path / "q", **FITS)
    # The eager engine keeps the Hub layout everywhere (its rows operator reads it as stored);
    # compile=True gives the stacks the compiled step reads: tiled already on an AMX machine, plain
    # elsewhere, laid out here. Only prefills run, nothing compiles.
    hub, tiled = (load_engine(folder, dtype="bfloat16", compile=compile) for compile in (False, True))
    assert all(ex.kernels in ((PLAIN, PLAIN), (ROWS, ROWS)) for ex in _experts(hub))
    for ex in _experts(tiled):
        if ex.kernels != (TILES, TILES):
            assert ex.kernels == (PLAIN, PLAIN) and ex.tiles_fit()
            ex.lay_out_tiles()
    assert all(ex.kernels == (TILES, TILES) for ex in _experts(tiled))
    before = _logits(hub)
    assert before.abs().max() > 0.5  # logits of some size, so that the bound below means something
    # bf16 products in another summation order: within bf16 rounding of the Hub layout's
    torch.testing.assert_close(_logits(tiled), before, rtol=0, atol=0.06)
    for engine in (hub, tiled):
        ex = _experts(engine)[0]
        gate_up, down = ex.resident_weights(0)  # in each engine's own layout
        for e in range(ex.num_experts):  # every expert of the first MoE layer becomes expert 0
            ex.replace_expert(e, (gate_up.clone(), down.clone()))
    after_hub, after_tiled = _logits(hub), _logits(tiled)
    assert (after_hub - before).abs().max() > 0.1  # the swap changed what the model computes
    torch.testing.assert_close(after_tiled, after_hub, rtol=0, atol=0.06)
