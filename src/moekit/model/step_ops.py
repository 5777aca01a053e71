"""The products of the decode step (T = 1) through moekit.ops: one implementation for eager and compiled.

Each module's `decode` method (Attention, MLAttention, MLP, RoutedExperts, MoE, Block) is written
with these, as plain tensor algebra with no data-dependent Python, so that torch.compile captures
the whole step as one graph (moekit.model.compiled_step) and the same code runs eagerly:
  - every projection is moekit::rows_gemv and the chosen experts moekit::experts_gemv (two small
    C++ operators, moekit.ops, that stream fp32/bf16 weight rows at memory speed and read the
    experts in place from the stacks); where they cannot be built, a projection of one row is the
    reduction `(x[:, None, :] * W).sum(-1)`, which Inductor vectorises, and the experts are read by
    indirect indexing `W[topk_ids]`, which compiled code reads in place (eager, the same expression
    copies the chosen experts: correct, not fast);
  - a uint8 weight is q8_0 blocks (`--weights int8`): moekit::rows_q8 / experts_q8, the eager int8
    kernel's own operators; a bf16 weight in the tiles layout (model.linear.TILES) rows_tiles.
Run eagerly (Decoder.forward's T = 1 step without --compile), the projections and experts of a
decoder prepared where the command loaded the operators (the ROWS kernel, chosen at prepare time:
moekit.model.linear) are rows_gemv / experts_gemv too (one row from memory 2-3× F.linear, measured);
the other products the compiled graph fuses are torch's own (F.linear for the PLAIN kernel; attention
over the cache SDPA, `attend`; the small products one matmul each, `einsum`), and a weight laid out
for an eager kernel (transposed, oneDNN, int4, MXFP4/FP8) runs that kernel, as the modules' forward
does; moekit.model.combinations refuses to compile such a decoder. Eagerly each op costs a few µs of
dispatch whatever its size, so the eager forms are the ones with the fewest ops per layer (issue 34:
the eager step had been 7-13% slower than the modules' forward, measured).
Legend: B rows (one token each), D hidden, E experts, K chosen, F expert width.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from moekit import ops
from moekit.model.linear import INT8, INT8_GEMV, PLAIN, ROWS, TILES, Kernel, Linear


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                kernel: Kernel = PLAIN) -> torch.Tensor:
    """x [B, in], weight [out, in] (Hub layout) → [B, out] for the weight's kernel (PLAIN, ROWS,
    TILES): eagerly the kernel's own product (F.linear, or moekit::rows_gemv where the command
    loaded the operators: ROWS); compiled, rows_gemv where it is built (moekit.ops), else one row
    as a reduction, which Inductor vectorises over `in` and parallelises over `out`, and more rows
    as a GEMM. A uint8 weight is q8_0 blocks (`--weights int8`): moekit::rows_q8, the eager int8
    kernel's own operator. TILES: a bf16 weight in the tiles layout (lay_out_tiles),
    moekit::rows_tiles, the eager TILES kernel's own operator."""
    if kernel is TILES:
        y = ops.op("moekit", "rows_tiles")(x, weight)
    elif weight.dtype == torch.uint8:
        y = op_for(weight, "rows_q8")(x, weight, grouped(ops.kind_of(weight)))
    elif not torch.compiler.is_compiling():
        # Eagerly the kernel's own product, whether or not this process happens to have the operators
        # registered: an eager step sums as its command asked (moekit.model.linear.ROWS).
        return kernel.apply(x, weight, bias)
    elif has_gemv():
        kind = ops.kind_of(weight)
        y = op_for(weight, "rows_gemv")(widened(x, kind), weight, grouped(kind)).to(x.dtype)
    else:
        y = (x[:, None, :] * weight).sum(-1) if x.shape[0] == 1 else x @ weight.t()
    return y if bias is None else y + bias


def project(m: Linear, x: torch.Tensor) -> torch.Tensor:
    """The Linear m on x [B, in]: the step's products for the layouts it reads (Hub, tiles, q8_0
    where the operators are loaded), else m's own kernel (an eager decoder's layouts)."""
    kernel = m.kernel
    if kernel is PLAIN or kernel is ROWS or kernel is TILES or (q8_operator(kernel) and has_gemv()):
        return linear_rows(x, m.weight, m.bias, kernel)
    return kernel.apply(x, m.weight, m.bias)


def q8_operator(kernel) -> bool:
    """Whether q8_0 weights of this kernel run moekit::rows_q8 / experts_q8 in the step: always when
    compiled; eagerly where that operator is the kernel measured faster here (INT8_GEMV), else the
    eager int8 kernel (the reference where it measured faster for this shape)."""
    return kernel is INT8_GEMV or (kernel is INT8 and torch.compiler.is_compiling())


def contract(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.einsum(equation, a, b) for two operands, written as a broadcast product summed over
    the contracted letters, which Inductor fuses with the ops around it into one loop nest.
    The batch-1 graph's attention uses it: at batch 1 the bmm calls einsum becomes cost ~10 µs each
    for a few thousand FMAs (measured). A batch keeps einsum, whose bmm is faster on a long cache.
    Eagerly at fp32 it is einsum's bmm (the broadcast product is a temporary of every pair's product:
    a batch-1 eager step 25% slower, measured), called as one matmul (`einsum` below); at bf16 it
    stays the broadcast sum, whose products round as the compiled graph's do (einsum's bmm flipped a
    near-tied expert on the tiny deepseek_v3)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32 and not torch.compiler.is_compiling():
        return einsum(equation, a, b)
    inputs, out = equation.replace(" ", "").split("->")
    left, right = inputs.split(",")
    letters = out + "".join(sorted(set(left + right) - set(out)))  # kept letters first, then summed
    a, b = _lift(a, left, letters), _lift(b, right, letters)
    return (a * b).sum(dim=tuple(range(len(out), len(letters))))


def einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.einsum(equation, a, b) for two operands; eagerly, where each kind of letter (batch, a's
    rows, the summed one, b's columns) is at most one dim, as the one matmul einsum itself reduces
    it to: the same bmm on the same operands, so the same floats, at half einsum's per-call cost
    (its planning and views: ~6 µs of ~13 for the step's small products, measured). Compiled,
    einsum (the graph's own plan)."""
    plan = None if torch.compiler.is_compiling() else _matmul_plan(equation)
    if plan is None:
        return torch.einsum(equation, a, b)
    a_order, b_order, out_order = plan
    x, w = a.permute(a_order), b.permute(b_order)
    if x.dim() == 2:  # einsum runs a product with no batch letter as a bmm too; mm sums in another order on some CPUs
        return torch.bmm(x.unsqueeze(0), w.unsqueeze(0)).squeeze(0).permute(out_order)
    return (x @ w).permute(out_order)  # [batch.., rows, columns] → the output's letters


@lru_cache(maxsize=None)
def _matmul_plan(equation: str) -> Optional[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """How `einsum` runs equation as one matmul: (a's permutation to [batch.., rows, summed],
    b's to [batch.., summed, columns], the product's to the output's letters), or None where it
    does not reduce to one (a letter summed on one side only, a repeated letter, two letters of
    a kind other than batch)."""
    inputs, out = equation.replace(" ", "").split("->")
    left, right = inputs.split(",")
    if len(set(left)) != len(left) or len(set(right)) != len(right):
        return None
    batch = [c for c in out if c in left and c in right]
    rows = [c for c in out if c in left and c not in right]
    columns = [c for c in out if c in right and c not in left]
    summed = [c for c in left if c in right and c not in out]
    if len(rows) != 1 or len(columns) != 1 or len(summed) != 1 or set(left + right) != set(out + summed[0]):
        return None
    if set(left) != set(batch + rows + summed) or set(right) != set(batch + summed + columns):
        return None  # a batch letter on one side only: einsum broadcasts it, a matmul would need a view
    made = batch + rows + columns
    return (tuple(left.index(c) for c in batch + rows + summed), tuple(right.index(c) for c in batch + summed + columns),
            tuple(made.index(c) for c in out))


def write_slots(stack: torch.Tensor, at: int, slot: torch.Tensor, values: torch.Tensor) -> None:
    """The cache write of one token per row: stack[at, r, .., slot[r], :] ← values[r] for each row r
    of values [B, .., W] (stack: the cache's tensors as one, KVCache.stack; stack[at] is a layer's
    [B_max, .., S, W]). Compiled, one index_put_ on the whole stack (a write through a view of it
    makes the graph copy the cache); eagerly through the layer's view, half the cost (~12 µs of ~24
    per layer for k and v, measured: no index tensors for `at` and the heads)."""
    rows = torch.arange(values.shape[0], device=values.device)  # [B]
    if not torch.compiler.is_compiling():
        stack[at][(rows,) + (slice(None),) * (values.dim() - 2) + (slot,)] = values
        return
    middle = [torch.arange(n, device=values.device).view((1, n) + (1,) * (values.dim() - 3 - i))
              for i, n in enumerate(values.shape[1:-1])]  # [1, n, 1..]: the dims between the row and the slot
    rows = rows.view((-1,) + (1,) * (values.dim() - 2))  # [B, 1..]
    stack.index_put_((torch.full_like(rows, at), rows, *middle, slot.view(rows.shape)), values)


def write_tokens(stack: torch.Tensor, at: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    """The cache write of T tokens per row (the prefill graph's): stack[at, r, .., slots[r, t], :] ←
    values[r, t] for values [B, T, .., W] (write_slots' form with a token dim): one index_put_ on
    the whole stack, as write_slots compiled."""
    b, t = slots.shape
    middle = [torch.arange(n, device=values.device).view((1, 1, n) + (1,) * (values.dim() - 4 - i))
              for i, n in enumerate(values.shape[2:-1])]  # [1, 1, n, 1..]: the dims between the row and the slot
    shape = (b, 1) + (1,) * (values.dim() - 3)
    rows = torch.arange(b, device=values.device).view(shape)  # [B, 1, 1..]
    index = (torch.full_like(rows, at), rows, *middle, slots.view((b, t) + (1,) * (values.dim() - 3)))
    stack.index_put_(index, values)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention of each row's one new token over the cache: q [B, Hkv, G, hd] (each
    kv head's G query heads), keys / values [B, Hkv, S, hd] (views of the cache), allowed [B, S]
    bool (the slots each row may see; its own always) → [B, Hkv, G, hd] in q's dtype.
    Compiled: moekit::attend where the operators are loaded (the cache read in place; the graph's
    own attention widened it to fp32 copies every layer), else the products, mask and softmax in
    fp32 as `contract` / einsum, which Inductor fuses. Eagerly: torch's SDPA, the modules' forward's
    attention, whether or not the operators are loaded (an eager step must not sum differently by
    that: tests/dist/test_expert_parallel.py caught it): one fused kernel where the products, mask
    and softmax were ~12 ops (~40 µs a layer, measured at batch 1)."""
    if not torch.compiler.is_compiling():
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None, None, :], scale=scale)
    if has_attend():
        return ops.op("moekit", "attend")(q.float(), keys, values, allowed, scale).to(q.dtype)
    product = contract if q.shape[0] == 1 else torch.einsum
    logits = product("bkgd,bksd->bkgs", q.float(), keys.float()) * scale  # [B, Hkv, G, S]
    probs = torch.softmax(logits.masked_fill(~allowed[:, None, None, :], float("-inf")), dim=-1)
    return product("bkgs,bksd->bkgd", probs, values.float()).to(q.dtype)


def _lift(t: torch.Tensor, have: str, letters: str) -> torch.Tensor:
    """t, whose dims are named by `have`, as a view with one dim per letter, in letters' order
    (size 1 where t has no such letter)."""
    t = t.permute([have.index(c) for c in letters if c in have])
    for i, c in enumerate(letters):
        if c not in have:
            t = t.unsqueeze(i)
    return t


# Which build of the operators runs each kind of weight here, and whether in groups: ops.variant,
# measured once per machine (persisted) before tracing (CompiledStep.__init__). Dynamo calls these
# while it traces and bakes their answers into the graph as constants: moekit.model.compiled_step
# marks them (CONSTANT_WHILE_TRACING) when it is imported, so that an eager process never imports
# Dynamo (~38 MB of RSS).
def _namespace(kind: str) -> str:
    return ops.variant(kind).namespace


def grouped(kind: str) -> bool:
    return ops.variant(kind).grouped


def _widen_batch(kind: str) -> bool:
    return ops.widen_batch(kind)


CONSTANT_WHILE_TRACING = (_namespace, grouped, _widen_batch)


def widened(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x as a product on this kind of weight takes it: a batch's rows widened to fp32 where that
    measured faster here than bf16 pairs (ops.widen_batch; the product is cast back to x's dtype,
    so the rounding points stay where they are), else x itself. A lone row keeps the pairs."""
    return x.float() if x.shape[0] != 1 and _widen_batch(kind) else x


def op_for(weight: torch.Tensor, name: str):
    """The operator `name` of the build chosen for this kind of weight."""
    return ops.op(_namespace(ops.kind_of(weight)), name)


def has_gemv() -> bool:
    # Read while Dynamo traces (a constant in the graph): whether the command loaded the operators.
    return ops.available("rows_gemv")


def has_latent_attend() -> bool:
    # Read while Dynamo traces, as has_gemv: MLA's attention over the cache as moekit::latent_attend.
    return ops.available("latent_attend")


def has_attend() -> bool:
    # Read while Dynamo traces, as has_gemv: grouped-query attention over the cache as moekit::attend.
    return ops.available("attend")
