"""The decode cache: every layer's tensors as views of one stack (what the compiled step reads)."""

from __future__ import annotations

import torch

from moekit.model.cache import KVCache, copy_row, slot_tensors, stacked_layers
from moekit.model.mla import MLACache


def test_equal_layers_become_views_of_one_zeroed_stack():
    meta = [(torch.empty(2, 4, 8, 16, device="meta"), torch.empty(2, 4, 8, 16, device="meta")) for _ in range(3)]
    layers, stack = stacked_layers(meta, "cpu")
    assert stack.shape == (6, 2, 4, 8, 16) and not stack.any()
    k, v = layers[1]
    k[0, 0, 3] = 1.0  # a write through the layer's entry lands in the stack, where the compiled step reads
    assert stack[2, 0, 0, 3].eq(1.0).all() and stack.sum() == 16
    assert v.data_ptr() == stack[3].data_ptr()


def test_mla_entries_keep_their_type_and_latent_width():
    meta = [MLACache(slots=torch.empty(1, 8, 12, device="meta"), latent_dim=8) for _ in range(2)]
    layers, stack = stacked_layers(meta, "cpu")
    assert stack.shape == (2, 1, 8, 12)
    assert all(isinstance(entry, MLACache) and entry.latent_dim == 8 for entry in layers)
    assert layers[1].slots.data_ptr() == stack[1].data_ptr()


def test_layers_of_different_shapes_get_tensors_of_their_own_and_no_stack():
    meta = [(torch.empty(1, 2, 8, 4, device="meta"),) * 2, (torch.empty(1, 1, 8, 4, device="meta"),) * 2]
    layers, stack = stacked_layers(meta, "cpu")
    assert stack is None
    tensors = [t for entry in layers for t, _ in slot_tensors(entry)]
    assert [tuple(t.shape) for t in tensors] == [(1, 2, 8, 4)] * 2 + [(1, 1, 8, 4)] * 2
    assert len({t.data_ptr() for t in tensors}) == 4 and not any(t.any() for t in tensors)


def test_a_stacked_entry_takes_an_in_place_write_that_carries_a_gradient():
    """Select views, not unbind's: autograd forbids in-place writes into multi-output views."""
    meta = [(torch.empty(1, 1, 4, 2, device="meta"),) * 2]
    [(k, _)], stack = stacked_layers(meta, "cpu")
    w = torch.ones(2, requires_grad=True)
    k[0, 0, 1] = w * 3.0
    stack.sum().backward()
    assert w.grad.tolist() == [3.0, 3.0]


def test_unstacked_caches_are_tensors_of_their_own():
    meta = [(torch.empty(1, 1, 4, 2, device="meta"),) * 2 for _ in range(2)]
    layers, stack = stacked_layers(meta, "cpu", stacked=False)
    assert stack is None and len({t.data_ptr() for entry in layers for t in entry}) == 4


def _filled(meta: list, batch: int, stacked: bool, seed: int) -> KVCache:
    layers, stack = stacked_layers(meta, "cpu", stacked=stacked)
    gen = torch.Generator().manual_seed(seed)
    for entry in layers:
        for t, _ in slot_tensors(entry):
            t.copy_(torch.randn(t.shape, generator=gen))
    return KVCache(layers=layers, key_mask=torch.ones(batch, 8, dtype=torch.bool), stack=stack)


def _tensors(cache: KVCache) -> list:
    return [t.clone() for entry in cache.layers for t, _ in slot_tensors(entry)]


def test_copy_row_through_the_stack_copies_what_each_layer_would():
    """copy_row's one copy over two stacks against its copy per layer tensor (unstacked caches)."""
    attention = lambda b: [(torch.empty(b, 2, 8, 4, device="meta"),) * 2 for _ in range(3)]  # noqa: E731
    mla = lambda b: [MLACache(slots=torch.empty(b, 8, 6, device="meta"), latent_dim=4) for _ in range(3)]  # noqa: E731
    for meta in (attention, mla):
        out = []
        for stacked in (True, False):
            dst, src = _filled(meta(3), 3, stacked, 0), _filled(meta(2), 2, stacked, 1)
            assert (dst.stack is not None) == stacked
            copy_row(dst, 2, src, 1, 5, src_start=2)  # a left-padded prefill's row into a batch row
            copy_row(dst, 0, dst, 2, 4)  # a row moved down within one cache
            out.append(_tensors(dst))
        assert all(torch.equal(a, b) for a, b in zip(*out))
        before = _tensors(_filled(meta(3), 3, True, 0))
        changed = [not torch.equal(a, b) for a, b in zip(before, out[0])]
        assert all(changed)  # every layer's tensor took the copy
