"""Each build of the operators (the machine's, an AVX2 one beside an AVX-512 one, the forced scalar one)
against moekit.ops.reference on the same inputs, and the properties a decode relies on: a row's floats
the same in a batch as alone, hidden positions never read, bad shapes refused."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from moekit.ops import (KINDS, Choice, bf16_tiles, c_shims, chosen, copy_into, from_tiles, kind_of, namespaces, op, reference,
                        rows_argmax, tiles_fit, to_tiles, variant, widen_batch)
from moekit.ops.build import NARROW
from moekit.ops.q8_0 import quantize_q8_0, round_to_q16
from moekit.ops.runtime import suffix
from moekit.ops.shims import C_ARGS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,out", [(1, 512, 300), (3, 515, 77), (8, 40, 17), (1, 7, 5), (8, 512, 300), (20, 256, 64),
                                              (5, 33, 9), (16, 515, 37)])
def test_rows_gemv_is_the_reference(ops, dtype, rows, width, out):
    gen = torch.Generator().manual_seed(rows * width + out)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    w = torch.randn(out, width, generator=gen).to(dtype)
    got = ops.rows_gemv(x, w)
    assert got.dtype == dtype and got.shape == (rows, out)
    want = reference.rows_gemv(x.float(), w)  # fp32 products of the same (rounded) inputs
    tol = 1e-5 * width ** 0.5 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_choice", [False, True])
@pytest.mark.parametrize("k", [70, 64], ids=["vectors", "tiles-where-amx"])
def test_experts_gemv_reads_each_rows_chosen_experts(ops, dtype, per_choice, k):
    gen = torch.Generator().manual_seed(7)
    b, c, e, n = 3, 2, 6, 33
    w = torch.randn(e, n, k, generator=gen).to(dtype)
    ids = torch.tensor([[1, 5], [0, 1], [5, 2]])
    x = torch.randn(b, c if per_choice else 1, k, generator=gen).to(dtype)
    got = ops.experts_gemv(x, w, ids)
    assert got.shape == (b, c, n)
    want = reference.experts_gemv(x.float(), w, ids)
    tol = 1e-4 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [515, 512], ids=["vectors", "tiles-where-amx"])
def test_a_batch_rows_floats_do_not_depend_on_the_batch_around_them(ops, dtype, width):
    """A batch's products take weight rows and x rows in blocks, each (weight row, x row) pair on
    chains of its own: a row's floats are the same bit for bit in a batch of 2 as in one of 9,
    whether a weight row falls in a block or among the rows left over, and for an expert's rows.
    At a width of 32s, bf16 batches run on AMX tiles where the CPU has them: the same holds there."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, width, generator=gen).to(dtype)
    w = torch.randn(37, width, generator=gen).to(dtype)
    full = ops.rows_gemv(x, w)
    for r in range(2, 9):
        assert torch.equal(ops.rows_gemv(x[:r], w), full[:r]), r
    assert torch.equal(ops.rows_gemv(x, w[1:]), full[:, 1:])  # every weight row at another place in its block
    stacks = torch.randn(3, 37, width, generator=gen).to(dtype)
    ids = torch.tensor([[0, 2]] * 6)  # experts 0 and 2 get 6 rows each
    experts = ops.experts_gemv(x[:6, None], stacks, ids)
    for r in range(2, 6):
        assert torch.equal(ops.experts_gemv(x[:r, None], stacks, ids[:r]), experts[:r]), r
    assert torch.equal(experts[:, 0], ops.rows_gemv(x[:6], stacks[0]))
    assert torch.equal(experts[:, 1], ops.rows_gemv(x[:6], stacks[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(4, 512), (16, 512), (16, 259)])
def test_a_served_batchs_chosen_experts_are_the_reference_and_each_experts_rows_product(ops, dtype, rows, width):
    """A serving step's shape: 4 to 16 rows each choosing 4 of 32 experts, so an expert gets 0 to
    several rows; each (row, choice) is the reference's product, and bit for bit that expert's
    rows_gemv on the same x row (with a width that leaves a tail past the vector loop too)."""
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, 1, width, generator=gen).to(dtype)
    stacks = torch.randn(32, 24, width, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(32, generator=gen)[:4] for _ in range(rows)])
    got = ops.experts_gemv(x, stacks, ids)
    want = reference.experts_gemv(x.float(), stacks, ids)
    tol = 1e-5 * width ** 0.5 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)
    for e in ids.unique().tolist():
        b, c = (ids == e).nonzero(as_tuple=True)
        if len(b) > 1:  # one row alone takes the one-row kernel, with chains of its own
            assert torch.equal(got[b, c], ops.rows_gemv(x[b, 0], stacks[e])), e


def test_bf16_weights_times_fp32_rows_are_fp32_products_of_the_same_weights(ops):
    """A batch widened to fp32 (moekit.ops.widen_batch) hands bf16 weights fp32 rows: the products are the
    fp32 products of those bf16 weights, for the projections and for the chosen experts."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 515, generator=gen)
    w = torch.randn(77, 515, generator=gen).to(torch.bfloat16)
    got = ops.rows_gemv(x, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w.float()), rtol=0, atol=1e-5 * 515 ** 0.5)
    stacks = torch.randn(4, 33, 515, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 3]] * 5 + [[1, 3]] * 3)
    got = ops.experts_gemv(x[:, None], stacks, ids)
    want = torch.stack([torch.stack([F.linear(x[b], stacks[e].float()) for e in ids[b].tolist()]) for b in range(8)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * 515 ** 0.5)


def test_an_expert_id_out_of_range_is_an_error_not_a_wild_read(ops):
    w = torch.randn(4, 8, 16)
    with pytest.raises(RuntimeError, match="expert id out of range"):
        ops.experts_gemv(torch.randn(1, 1, 16), w, torch.tensor([[4]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,out", [(1, 512, 300), (3, 515, 77), (2, 40, 17)])
def test_rows_q8_is_the_int8_reference(ops, dtype, rows, width, out):
    """Widths that are not whole blocks of 32 are padded inside the operator, as the reference pads."""
    gen = torch.Generator().manual_seed(rows + width + out)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    packed = quantize_q8_0(torch.randn(out, width, generator=gen))
    got = ops.rows_q8(x, packed)
    assert got.dtype == dtype and got.shape == (rows, out)
    want = reference.rows_q8(x.float(), packed)
    tol = 1e-5 * width ** 0.5 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("per_choice", [False, True])
def test_experts_q8_reads_each_rows_chosen_experts(ops, per_choice):
    gen = torch.Generator().manual_seed(11)
    b, c, e, n, k = 3, 2, 6, 33, 70
    stack = torch.stack([quantize_q8_0(torch.randn(n, k, generator=gen)) for _ in range(e)])  # [E, N, nb·34]
    ids = torch.tensor([[1, 5], [0, 1], [5, 2]])
    x = torch.randn(b, c if per_choice else 1, k, generator=gen)
    got = ops.experts_q8(x, stack, ids)
    assert got.shape == (b, c, n)
    want = reference.experts_q8(x, stack, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    with pytest.raises(RuntimeError, match="expert id out of range"):
        ops.experts_q8(x, stack, torch.tensor([[6, 0]] * b))


@pytest.mark.parametrize("rows", [2, 3, 4, 7, 9, 17, 40])
def test_a_row_of_a_q8_batch_is_its_solo_product_bit_for_bit(ops, rows):
    """Few rows are multiplied one at a time against several weight rows in the vector lanes, many
    rows in the lanes themselves (16 or 8 a set, the last set part empty); both sum each block
    exactly in integers and add the blocks in the same order, so batching cannot move an int8
    greedy token (odd block counts, and weight rows short of a full set of lanes, included)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 3 * 32 + 5, generator=gen)  # 4 blocks, the last padded
    packed = quantize_q8_0(torch.randn(40, x.shape[1], generator=gen))
    stack = torch.stack([packed, quantize_q8_0(torch.randn(40, x.shape[1], generator=gen))])  # [E = 2, N, nb·34]
    ids = torch.zeros(rows, 1, dtype=torch.int64)  # every row on expert 0: one weight read for all rows
    batch, experts = ops.rows_q8(x, packed), ops.experts_q8(x[:, None], stack, ids)[:, 0]
    solo = torch.cat([ops.rows_q8(x[i : i + 1], packed) for i in range(rows)])
    assert torch.equal(batch, solo) and torch.equal(experts, solo)


def test_a_q8_product_rounds_x_to_int16_exactly_as_the_reference(ops):
    """Weight rows that pick one input each (code 1, scale 1.0) give back x as the operator rounded
    it, q · s, bit for bit: the vector rounding (AVX-512) is the plain one's, ties to even included."""
    gen = torch.Generator().manual_seed(3)
    width = 4 * 32
    x = torch.randn(2, width, generator=gen)
    x[1, 32:64] = torch.arange(32) * 0.5 + 0.25  # a block whose largest |x| leaves quotients near halves
    x[1, 64:96] = 0.0  # a block of zeros: scale 0, codes 0
    x[1, 96] = 1e-30  # one tiny value beside zeros
    picks = torch.zeros(width, width // 32, 34, dtype=torch.uint8)  # [N = width, nb, 34]
    picks[..., :2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # every block's scale 1.0
    for n in range(width):
        picks[n, n // 32, 2 + n % 32] = 1
    got = ops.rows_q8(x, picks.view(width, -1))
    assert torch.equal(got, round_to_q16(x))


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q8_0"])
def test_a_weight_row_gets_the_same_float_in_a_group_as_alone(ops, kind):
    """At batch 1 the operators multiply a few consecutive weight rows at once (more streams from
    memory in flight); each row's arithmetic stays the one-row order, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    width, out = 3 * 64 + 16 + 3, 13  # the vector loop, its one-vector tail and a scalar tail; 13 rows: groups and leftovers
    w = torch.randn(out, width, generator=gen)
    if kind == "q8_0":
        x, w, op = torch.randn(1, width, generator=gen), quantize_q8_0(w), ops.rows_q8
    else:
        dtype = getattr(torch, kind)
        x, w, op = torch.randn(1, width, generator=gen).to(dtype), w.to(dtype), ops.rows_gemv
    together = op(x, w, True)
    alone = torch.cat([op(x, w[n : n + 1], True) for n in range(out)], dim=1)  # one row: no group
    assert torch.equal(together, alone) and torch.equal(op(x, w, False), together)
    stack = w[None].expand(2, *w.shape).contiguous()  # the experts' path: rows of expert 1
    experts = getattr(ops, "experts_q8" if kind == "q8_0" else "experts_gemv")
    for grouped in (True, False):
        assert torch.equal(experts(x[:, None], stack, torch.tensor([[1]]), grouped)[:, 0], together)


def test_each_kind_of_weight_gets_a_built_variant_and_others_the_default(machine_builds):
    """The choice is a measurement on this machine, so only its form is checked: one of the builds
    here, grouped or not, per kind the operators know; the default for any other (and, above, every
    build agrees with its reference, grouped or not)."""
    assert all(variant(kind).namespace in namespaces() and isinstance(variant(kind).grouped, bool) for kind in KINDS)
    assert variant("float16") == Choice()
    assert all(chosen()[kind].startswith(variant(kind).label) for kind in KINDS)  # what a benchmark records
    assert isinstance(widen_batch("bfloat16"), bool) and not widen_batch("float32") and not widen_batch("q8_0")
    assert [kind_of(t) for t in (torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.uint8))] == list(KINDS)


@pytest.mark.parametrize("rows,width", [(1, 1), (1, 7), (3, 16), (2, 17), (8, 1000), (1, 32000)])
def test_rows_argmax_is_torch_argmax(ops, rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=gen)
    assert torch.equal(ops.rows_argmax(x), reference.rows_argmax(x))
    ties = torch.randint(0, 3, (rows, width), generator=gen).float()  # many equal maxima: the first wins
    assert torch.equal(ops.rows_argmax(ties), ties.argmax(-1))


def test_rows_argmax_ranks_nan_first_and_handles_all_minus_inf(ops):
    x = torch.randn(4, 40)
    x[0, 33] = float("nan")  # a NaN after the max
    x[1, 2] = x[1, 39] = float("nan")  # the first of two NaNs
    x[2] = float("-inf")  # a row that masked everything
    x[3, 5] = x[3, 25] = float("inf")
    want = x.argmax(-1)
    assert want.tolist() == [33, 2, 0, 5]
    assert torch.equal(ops.rows_argmax(x), want)
    assert torch.equal(ops.rows_argmax(x[:, ::2]), x[:, ::2].argmax(-1))  # a strided view


def test_rows_argmax_helper_falls_back_to_torch_where_the_operator_does_not_apply(machine_builds):
    for x in (torch.randn(3, 50, dtype=torch.bfloat16), torch.randn(50), torch.randn(2, 3, 50)):
        assert torch.equal(rows_argmax(x), x.argmax(dim=-1))
    x = torch.randn(2, 50)
    assert torch.equal(rows_argmax(x), x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="V > 0"):
        op("moekit", "rows_argmax")(torch.empty(2, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1024, 512), (48, 33), (37, 100), (16, 16), (5, 3), (1, 40)])
@pytest.mark.parametrize("aligned", [True, False], ids=["streamed-where-rows-align", "offset"])
def test_transpose_into_is_the_transposed_copy_bit_for_bit(ops, dtype, rows, cols, aligned):
    """Tiles, the rows and columns they leave, and an out whose rows are not aligned (no streaming
    stores): every element is src's, widened exactly; nothing outside out is written."""
    src = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)).to(dtype)
    room = torch.full((rows * cols + 64,), -7.0)
    at = 0 if aligned else 3
    out = room[at : at + rows * cols].view(cols, rows)
    ops.transpose_into(src, out)
    want = torch.empty_like(out)
    reference.transpose_into(src, want)
    assert torch.equal(out, want)
    assert bool((room[:at] == -7).all()) and bool((room[at + rows * cols :] == -7).all())


def test_transpose_into_refuses_what_it_does_not_lay_out(ops):
    with pytest.raises(RuntimeError, match="contiguous fp32 or bf16"):
        ops.transpose_into(torch.randn(8, 4, dtype=torch.float16), torch.empty(4, 8))
    with pytest.raises(RuntimeError, match="out a contiguous fp32"):
        ops.transpose_into(torch.randn(8, 4), torch.empty(8, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_into_is_copy_whichever_way_it_goes(machine_builds, dtype):
    """The store's helper: the operator for a contiguous matrix's transpose into fp32, torch's copy
    for anything else (fp16, a plain view, a bf16 destination): the same values every way."""
    hub = torch.randn(96, 40).to(dtype)
    for view, out_dtype in ((hub.t(), torch.float32), (hub, torch.float32), (hub.t(), torch.bfloat16), (hub[:, :20].t(), torch.float32)):
        out = torch.empty(view.shape, dtype=out_dtype)
        assert copy_into(out, view) is out
        assert torch.equal(out, view.to(out_dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,positions,r,rope", [(1, 16, 1, 256, 32), (1, 8, 37, 128, 32), (3, 4, 40, 40, 8), (2, 3, 19, 7, 5)])
def test_latent_attend_is_softmax_attention_over_the_cache(ops, dtype, rows, heads, positions, r, rope):
    """MLA's attention over its cache read in place (a slice of a cache stack: rows apart by the
    stack's stride), masked positions, latent widths on and off the vector width: within fp32
    rounding of softmax(q·k)·v computed by torch."""
    gen = torch.Generator().manual_seed(rows * heads * positions + r)
    stack = torch.randn(2, rows + 1, positions + 5, r + rope, generator=gen).to(dtype)
    cached = stack[1, :rows, :positions]
    query = torch.randn(rows, heads, r + rope, generator=gen)
    visible = torch.rand(rows, positions, generator=gen) < 0.7
    visible[:, -1] = True  # a decode row always sees its own position
    got = ops.latent_attend(query, cached, visible, 0.125, r)
    assert got.shape == (rows, heads, r) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference.latent_attend(query, cached, visible, 0.125, r), rtol=1e-5, atol=1e-5)


def test_latent_attend_ignores_what_the_mask_hides_and_refuses_bad_shapes(ops):
    cached = torch.randn(1, 6, 40)
    visible = torch.tensor([[True, False, True, False, True, True]])
    query = torch.randn(1, 2, 40)
    want = ops.latent_attend(query, cached, visible, 0.5, 32)
    cached[0, 1] = float("nan")  # a hidden position's garbage never reaches the output
    cached[0, 3] = float("inf")
    assert torch.equal(ops.latent_attend(query, cached, visible, 0.5, 32), want)
    with pytest.raises(RuntimeError, match="visible bool"):
        ops.latent_attend(query, cached, visible[:, :5], 0.5, 32)
    with pytest.raises(RuntimeError, match="0 < r <= C"):
        ops.latent_attend(query, cached, visible, 0.5, 41)
    with pytest.raises(RuntimeError, match="query fp32"):
        ops.latent_attend(query.bfloat16(), cached, visible, 0.5, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,kv_heads,group,positions,dim", [(1, 4, 2, 1, 64), (1, 2, 1, 37, 64), (3, 4, 2, 40, 128), (2, 1, 3, 19, 40)])
def test_attend_is_grouped_query_attention_over_the_cache(ops, dtype, rows, kv_heads, group, positions, dim):
    """Grouped-query attention over keys and values read in place (slices of a cache stack [N, B,
    Hkv, S, D], as the compiled step passes them), masked positions, head widths on and off the
    vector width: within fp32 rounding of softmax(q·k)·v computed by torch."""
    gen = torch.Generator().manual_seed(rows * kv_heads * positions + dim)
    stack = torch.randn(4, rows + 1, kv_heads, positions + 5, dim, generator=gen).to(dtype)
    keys, values = stack[2, :rows, :, :positions], stack[3, :rows, :, :positions]
    query = torch.randn(rows, kv_heads, group, dim, generator=gen)
    allowed = torch.rand(rows, positions, generator=gen) < 0.7
    allowed[:, -1] = True  # a decode row always sees its own position
    got = ops.attend(query, keys, values, allowed, 0.125)
    assert got.shape == (rows, kv_heads, group, dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference.attend(query, keys, values, allowed, 0.125), rtol=1e-5, atol=1e-5)


def test_attend_ignores_what_the_mask_hides_and_refuses_bad_shapes(ops):
    keys, values = torch.randn(2, 1, 2, 6, 32).unbind(0)
    allowed = torch.tensor([[True, False, True, False, True, True]])
    query = torch.randn(1, 2, 3, 32)
    want = ops.attend(query, keys, values, allowed, 0.5)
    keys[0, :, 1] = float("nan")  # a hidden position's garbage never reaches the output
    values[0, :, 3] = float("inf")
    assert torch.equal(ops.attend(query, keys, values, allowed, 0.5), want)
    with pytest.raises(RuntimeError, match="allowed bool"):
        ops.attend(query, keys, values, allowed[:, :5], 0.5)
    with pytest.raises(RuntimeError, match="alike"):
        ops.attend(query, keys, values.bfloat16(), allowed, 0.5)
    with pytest.raises(RuntimeError, match="query fp32"):
        ops.attend(query.bfloat16(), keys, values, allowed, 0.5)
    with pytest.raises(RuntimeError, match="keys \\[B, Hkv, S, D\\] for query"):
        ops.attend(query[:, :1], keys, values, allowed, 0.5)


def test_each_built_operator_has_a_c_entry_point_the_compiled_step_can_find(machine_builds):
    """The compiled step's generated C++ calls these symbols by name (moekit.ops.c_shims): each must be
    declared for its own build's operator and be visible process-wide."""
    shims = c_shims()
    assert len(shims) == len(C_ARGS) * len(namespaces())  # the products, attention and the packed experts'
    process = ctypes.CDLL(None)  # the global scope a newly loaded library resolves against
    for overload, (declaration,) in shims.items():
        name = declaration.split("(")[0].split()[-1]
        space, op_name = overload.name().split("::")
        assert name == f"aoti_torch_cpu_{op_name}" and op_name.endswith(suffix(space))
        assert getattr(process, name) is not None


def test_a_bf16_batch_runs_on_amx_tiles_exactly_where_the_cpu_has_them(machine_builds):
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    assert bf16_tiles() == ("amx_bf16" in flags and "amx_tile" in flags)
    if NARROW.namespace in namespaces():
        assert op(NARROW.namespace, "bf16_tiles")() is False  # the AVX2 build has no tiles
    label = chosen()["bfloat16"]
    assert ("AMX tiles" in label) == (bf16_tiles() and not widen_batch("bfloat16"))


@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (3, 32, 64)], ids=["one-tile", "blocks", "a-stack"])
def test_tiles_hold_each_block_tile_by_tile_and_give_the_hub_weight_back(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    tiled = to_tiles(w)
    assert tiled.shape == w.shape and tiled.is_contiguous() and tiles_fit(w)
    assert torch.equal(from_tiles(tiled), w)
    flat, hub = tiled.reshape(-1, *shape[-2:]), w.reshape(-1, *shape[-2:])
    n, k = shape[-2:]
    for e in range(flat.shape[0]):
        stream = flat[e].reshape(-1)
        for b in range(n // 16):
            for t in range(k // 32):  # the t-th 1 KB of block b: its 16 rows' inputs 32 t .. 32 t + 31
                at = (b * (k // 32) + t) * 512
                assert torch.equal(stream[at : at + 512].view(16, 32), hub[e, 16 * b : 16 * b + 16, 32 * t : 32 * t + 32])
    assert not tiles_fit(w.float()) and not tiles_fit(torch.zeros(40, 32).bfloat16()) and not tiles_fit(torch.zeros(16, 48).bfloat16())


@pytest.mark.parametrize("rows", [1, 2, 16, 17, 40], ids=lambda r: f"{r}-rows")
@pytest.mark.parametrize("out,width", [(64, 512), (48, 96)])
def test_rows_tiles_is_the_reference(machine_builds, rows, out, width):
    """One row on the vector kernel; more on AMX tiles where the CPU has them, 16 rows a pass."""
    gen = torch.Generator().manual_seed(rows + out)
    x = torch.randn(rows, width, generator=gen).bfloat16()
    w = torch.randn(out, width, generator=gen).bfloat16()
    got = op("moekit", "rows_tiles")(x, to_tiles(w))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    want = reference.rows_tiles(x.float(), to_tiles(w))  # fp32 products of the same inputs: the output's bf16 rounding
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-4)  # and the order of the sums differ


@pytest.mark.parametrize("batch", [1, 3, 20])
@pytest.mark.parametrize("per_choice", [False, True])
def test_experts_tiles_reads_each_rows_chosen_experts(machine_builds, batch, per_choice):
    gen = torch.Generator().manual_seed(batch)
    c, e, n, k = 3, 8, 48, 64
    w = torch.randn(e, n, k, generator=gen).bfloat16()
    ids = torch.randint(0, e, (batch, c), generator=gen)
    x = torch.randn(batch, c if per_choice else 1, k, generator=gen).bfloat16()
    got = op("moekit", "experts_tiles")(x, to_tiles(w), ids)
    assert got.shape == (batch, c, n) and got.dtype == torch.bfloat16
    want = reference.experts_tiles(x.float(), to_tiles(w), ids)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=1e-2 * want.abs().max().item())


def test_a_batch_row_on_tiles_is_untouched_by_a_neighbour_full_of_nan_and_inf(ops):
    """On AMX a tile row of x pairs is 16 rows wide and holds only the rows a call has, packed: the
    columns past them are the next rows' pairs, whose outputs are dropped. A row's floats must come
    out as they do without its neighbours, however wild theirs are (in the Hub layout and in tiles,
    for a projection and for experts)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    x[1], x[3] = float("nan"), float("inf")
    sane = [0, 2, 4]
    w = torch.randn(48, 64, generator=gen).bfloat16()
    rows_tiles = op("moekit", "rows_tiles")
    assert torch.equal(rows_tiles(x, to_tiles(w))[sane], rows_tiles(x[sane], to_tiles(w)))
    assert torch.equal(ops.rows_gemv(x, w)[sane], ops.rows_gemv(x[sane], w))
    stacks = torch.randn(3, 48, 64, generator=gen).bfloat16()
    ids = torch.tensor([[0, 2], [0, 1], [2, 1], [0, 2], [1, 0]])  # every expert shares its rows with a wild one
    got = op("moekit", "experts_tiles")(x[:, None], to_tiles(stacks), ids)
    assert torch.equal(got[sane], op("moekit", "experts_tiles")(x[sane, None], to_tiles(stacks), ids[sane]))
    assert torch.equal(ops.experts_gemv(x[:, None], stacks, ids)[sane], ops.experts_gemv(x[sane, None], stacks, ids[sane]))


def test_the_tiles_operators_refuse_what_is_not_in_tiles(machine_builds):
    rows, experts = op("moekit", "rows_tiles"), op("moekit", "experts_tiles")
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="N % 16 == 0 and K % 32 == 0"):
        rows(x, torch.zeros(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x is bf16"):
        rows(x.float(), torch.zeros(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous bf16 weight"):
        rows(x, torch.zeros(32, 64))
    with pytest.raises(RuntimeError, match="expert id out of range"):
        experts(x[:, None], torch.zeros(4, 32, 64).bfloat16(), torch.tensor([[0], [4]]))
