"""Moving a model's weights into huge pages changes where they live, never what they are or what
shares them."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from moekit.engine.loader import load_engine
from moekit.model.huge_pages import HUGE_PAGE, MIN_BYTES, huge_page_arena, module_tensors, move_to_huge_pages
from tests.engine.hf_tiny import write_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")


class Holder(nn.Module):
    """A parameter, per-row views of it kept in a tuple, a view's base held only through the view,
    a buffer, a tied parameter and a small tensor that stays put."""

    def __init__(self):
        super().__init__()
        self.stack = nn.Parameter(torch.randn(4, 64, 128), requires_grad=False)
        self.rows = (tuple(self.stack),)  # nested, as RoutedExperts._weights
        self.packed = torch.arange(4 * 64 * 128, dtype=torch.float32).view(4, 64, 128)  # a view of a base
        self.register_buffer("table", torch.randn(256, 128))
        self.small = torch.randn(8)
        self.child = nn.Linear(100, 100)
        self.tied = nn.Linear(100, 100, bias=False)
        self.tied.weight = self.child.weight


def _values(module):
    return [t.clone() for t in module_tensors(module)]


def test_weights_move_into_one_mapping_with_their_values_and_aliases():
    m = Holder()
    before = _values(m)
    small_at = m.small.data_ptr()
    moved = move_to_huge_pages(m)
    assert moved.kept == []
    assert moved.storages == 3  # stack (and its views), packed's base, table; the Linears (40 KB) stay put
    assert all(torch.equal(a, b) for a, b in zip(before, module_tensors(m)))
    assert m.small.data_ptr() == small_at
    # One mapping: the moved storages are views of one arena, the first on a 2 MB boundary.
    storages = {t.untyped_storage().data_ptr() for t in (m.stack, m.packed, m.table)}
    assert len(storages) == 1
    assert min(t.data_ptr() for t in (m.stack, m.packed._base, m.table)) % (2 << 20) == 0
    # Views still view their base: a write through one reaches the other.
    m.rows[0][2][5, 7] = 123.0
    assert m.stack[2, 5, 7] == 123.0
    m.packed._base[0] = -1.0
    assert m.packed.flatten()[0] == -1.0
    assert m.tied.weight is m.child.weight
    assert isinstance(m.stack, nn.Parameter)


def test_a_storage_held_outside_the_model_stays_where_it_is():
    m = Holder()
    outside = m.table[:10]  # someone else's view of the buffer
    at = m.table.data_ptr()
    moved = move_to_huge_pages(m)
    assert m.table.data_ptr() == at
    assert len(moved.kept) == 1 and "outside the model" in moved.kept[0]
    m.table[0, 0] = 7.0
    assert outside[0, 0] == 7.0  # the alias holds
    assert m.stack.untyped_storage().nbytes() >= MIN_BYTES and moved.storages == 2


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_a_onednn_packed_weight_stays_in_onednn_and_the_rest_moves():
    """oneDNN's packed weights (the bf16 kernel where it measures fastest) have no storage to move."""
    m = Holder()
    m.onednn = torch.randn(256, 256).to_mkldnn()
    want = m.onednn.to_dense()
    moved = move_to_huge_pages(m)
    assert moved.storages == 3 and m.onednn.is_mkldnn
    assert torch.equal(m.onednn.to_dense(), want)


@pytest.mark.parametrize("family", ("qwen3_moe", "deepseek_v3"))
@pytest.mark.parametrize("weights", ("dtype", "int8"))
def test_a_loaded_engine_decodes_the_same_after_a_second_move(tmp_path, family, weights):
    """load_engine moves a resident model's weights already; moving them again is a plain copy, and
    decoding must not change (eager and int8 experts, whose q8_0 stacks are views)."""
    engine = load_engine(write_checkpoint(family, tmp_path), weights=weights, compile=False)
    prompt = [[5, 9, 33, 7, 81]]
    want = engine.generate(prompt, max_new_tokens=6, stop_ids=()).token_ids
    moved = move_to_huge_pages(engine.decoder)
    assert moved.kept == []
    assert engine.generate(prompt, max_new_tokens=6, stop_ids=()).token_ids == want


@pytest.mark.parametrize("held", ("hub-stacks", "mxfp4-stacks"))
def test_the_expert_stacks_a_form_holds_move_with_their_views(tmp_path, held):
    """The stacks a resident experts form holds, and its per-expert views of them (the Hub layout a
    load for --compile keeps; MXFP4 kept packed), are the model's: load_engine moved them, so a
    second move keeps nothing back, and an expert's view still views its stack."""
    from quantized_files import write_mxfp4

    wide = dict(hidden_size=256, intermediate_size=256)  # stacks past MIN_BYTES
    folder = (write_checkpoint("qwen3_moe", tmp_path, moe_intermediate_size=256, **wide) if held == "hub-stacks"
              else write_mxfp4(tmp_path, **wide))
    decoder = load_engine(folder, compile=held == "hub-stacks").decoder
    ex = next(b.ffn.experts for b in decoder.layers if hasattr(b.ffn, "experts"))
    assert ex.form.stacks[0] is ex.gate_up
    moved = move_to_huge_pages(decoder)
    assert moved.kept == [] and moved.storages > 0
    ex.form.gate_up[1].view(-1)[0] = 7
    assert ex.gate_up[1].view(-1)[0] == 7


def test_an_arena_starts_on_a_huge_page_and_holds_what_is_written():
    arena = huge_page_arena(3 * HUGE_PAGE + 100)
    assert arena.numel() == 3 * HUGE_PAGE + 100 and arena.dtype == torch.uint8
    assert arena.data_ptr() % HUGE_PAGE == 0
    assert int(arena.max()) == 0  # anonymous memory: zeros until written
    arena[-100:] = 7
    assert int(arena.sum()) == 700
