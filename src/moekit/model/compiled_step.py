"""The decode step (T = 1) as one torch.compile graph: the fast path beside the eager Decoder.

Why a second formulation of the same step: the eager step is ~2,000 small ops, and on a CPU their
fixed cost (dispatch, allocation, one-row GEMMs that MKL and oneDNN run well below memory speed)
is most of a token's time. Written as plain tensor algebra with no data-dependent Python, the whole
step compiles into one graph of a few dozen kernels:
  - every projection is moekit::rows_gemv and the chosen experts moekit::experts_gemv (two small
    C++ operators, moekit.ops, that stream fp32/bf16 weight rows at memory speed and read the
    experts in place from the stacks); where they cannot be built, a projection of one row is the
    reduction `(x[:, None, :] * W).sum(-1)`, which Inductor vectorises, and the experts are read by
    indirect indexing `W[topk_ids]`, which compiled code reads in place (eager, the same expression
    would copy the experts: this step is compile-only);
  - routing is the shared `route()` (so every family's order of operations is the one the eager
    path and the reference use);
  - the KV cache is the Decoder's own, one tensor for all layers (KVCache.stack, whose views the
    eager layers use), written in place with one index_put_ on it per k / v at each row's slot;
    attention runs over slots 0..end-1 only (end is a dynamic size, not a recompile); in the
    batch-1 graph its products are `contract` (broadcast and sum, fused by Inductor with the mask
    and softmax), in a batch's graph einsum's bmm. One tensor,
    not one per layer: each input's length would be a dynamic size of its own, passed and checked
    every step.
Dynamo traces and Inductor compiles each graph once; the steps after it call the generated code
directly (moekit.model.direct_graph: the graph's own shape guards, no Dynamo frame that fetches
~80 weights through the modules again each token), ~0.1-0.2 ms less a step on a CPU.
It reads the Decoder's parameters in the Hub layout (the decoder is prepared with
`kernels=False`), so it costs no second copy of the weights, except on a machine with AMX, where
a bf16 decoder's projections and expert stacks are first laid out in tiles (`lay_out_tiles`,
moekit.ops.to_tiles: ~20% faster batch products, ~10% one-row ones, measured), in place of
the Hub layout, and the eager forward reads them through the TILES kernel. The eager forward of
the same decoder (or, for tiles, of a plain one) stays the reference: tests/model/test_compiled_step.py holds the two to identical greedy
tokens and fp32 logits within 1e-4 for every family it runs.

Latent attention (MLA) runs its absorbed form, as the eager decode does. What it does not run (the
decoder then takes its eager step, and `unsupported()` says why): llama4 attention, the expert
store, MXFP4 / FP8 weights, per-row K (tiers), routing policies, hooks. int8 weights (q8_0 blocks,
`--weights int8` / `int8-experts`) run through moekit::rows_q8 / experts_q8, the operator the eager
int8 kernel calls, reading the q8_0 stacks in place.
Batch sizes and cache lengths are dynamic; batch 1 gets its own graph (Dynamo specialises 1).
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from moekit import ops
from moekit.model.attention import Attention
from moekit.model.direct_graph import DirectGraph, direct_graph, held_tensors
from moekit.model.experts import RoutedExperts
from moekit.model.linear import INT8, INT8_GEMV, PLAIN, TILES, Linear
from moekit.model.mla import MLAttention
from moekit.model.mlp import MLP
from moekit.model.moe import MoE
from moekit.model.norms import LayerNorm, RMSNorm, rms_normalize
from moekit.model.routing import RoutingDecision, route
from moekit.ops.torch_private import assume_constant_result, compile_fx, mark_dynamic


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                tiles: bool = False) -> torch.Tensor:
    """x [B, in], weight [out, in] (Hub layout) → [B, out]: moekit::rows_gemv where it is built
    (moekit.ops); else one row as a reduction, which Inductor vectorises over `in` and
    parallelises over `out`, and more rows as a GEMM. A uint8 weight is q8_0 blocks (`--weights
    int8`): moekit::rows_q8, the eager int8 kernel's own operator. tiles: a bf16 weight in the tiles
    layout (lay_out_tiles), moekit::rows_tiles, the eager TILES kernel's own operator."""
    if tiles:
        y = ops.op("moekit", "rows_tiles")(x, weight)
    elif weight.dtype == torch.uint8:
        y = _op(weight, "rows_q8")(x, weight, _grouped(ops.kind_of(weight)))
    elif _has_gemv():
        kind = ops.kind_of(weight)
        y = _op(weight, "rows_gemv")(_widened(x, kind), weight, _grouped(kind)).to(x.dtype)
    else:
        y = (x[:, None, :] * weight).sum(-1) if x.shape[0] == 1 else x @ weight.t()
    return y if bias is None else y + bias


def _project(m: Linear, x: torch.Tensor) -> torch.Tensor:
    """The Linear m on x [B, in], in whichever layout lay_out_tiles left its weight."""
    return linear_rows(x, m.weight, m.bias, m.kernel is TILES)


def lay_out_tiles(decoder) -> None:
    """Where bf16 weights stream faster in tiles here (moekit.ops.tiles_ready: an AMX machine),
    every plain bf16 projection that fits (moekit.model.linear.TILES) and every plain bf16 expert
    stack (RoutedExperts.lay_out_tiles) in that layout, in place of the Hub layout: still one copy.
    The eager forward (prefill, tiers) runs the same operator through the TILES kernel."""
    linears = [m for m in decoder.modules() if isinstance(m, Linear) and m.kernel is PLAIN and ops.tiles_fit(m.weight)]
    stacks = [m for m in decoder.modules() if isinstance(m, RoutedExperts) and m.tiles_fit()]
    if not (linears or stacks) or not ops.tiles_ready():
        return
    for m in linears:
        m.prepare(TILES)
    for m in stacks:
        m.lay_out_tiles()


def contract(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.einsum(equation, a, b) for two operands, written as a broadcast product summed over
    the contracted letters, which Inductor fuses with the ops around it into one loop nest.
    The batch-1 graph's attention uses it: at batch 1 the bmm calls einsum becomes cost ~10 µs each
    for a few thousand FMAs (measured). A batch keeps einsum, whose bmm is faster on a long cache."""
    inputs, out = equation.replace(" ", "").split("->")
    left, right = inputs.split(",")
    letters = out + "".join(sorted(set(left + right) - set(out)))  # kept letters first, then summed
    a, b = _lift(a, left, letters), _lift(b, right, letters)
    return (a * b).sum(dim=tuple(range(len(out), len(letters))))


def _lift(t: torch.Tensor, have: str, letters: str) -> torch.Tensor:
    """t, whose dims are named by `have`, as a view with one dim per letter, in letters' order
    (size 1 where t has no such letter)."""
    t = t.permute([have.index(c) for c in letters if c in have])
    for i, c in enumerate(letters):
        if c not in have:
            t = t.unsqueeze(i)
    return t


# Which build of the operators runs each kind of weight here, and whether in groups: ops.variant,
# measured once per machine (persisted) before tracing (CompiledStep.__init__). Dynamo calls these two while it
# traces and bakes their answers into the graph as constants.
@assume_constant_result
def _namespace(kind: str) -> str:
    return ops.variant(kind).namespace


@assume_constant_result
def _grouped(kind: str) -> bool:
    return ops.variant(kind).grouped


@assume_constant_result
def _widen_batch(kind: str) -> bool:
    return ops.widen_batch(kind)


def _widened(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x as a product on this kind of weight takes it: a batch's rows widened to fp32 where that
    measured faster here than bf16 pairs (ops.widen_batch; the product is cast back to x's dtype,
    so the rounding points stay where they are), else x itself. A lone row keeps the pairs."""
    return x.float() if x.shape[0] != 1 and _widen_batch(kind) else x


def _op(weight: torch.Tensor, name: str):
    """The operator `name` of the build chosen for this kind of weight."""
    return ops.op(_namespace(ops.kind_of(weight)), name)


def _has_gemv() -> bool:
    # Read while Dynamo traces (a constant in the graph): whether the command loaded the operators.
    return ops.available("rows_gemv")


def _has_latent_attend() -> bool:
    # Read while Dynamo traces, as _has_gemv: MLA's attention over the cache as moekit::latent_attend.
    return ops.available("latent_attend")


def _has_attend() -> bool:
    # Read while Dynamo traces, as _has_gemv: grouped-query attention over the cache as moekit::attend.
    return ops.available("attend")


def _mlp(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    """A dense MLP (or shared expert) on x [B, D] → [B, D]."""
    return _project(mlp.down, mlp.act(_project(mlp.gate_up, x)))


def _experts(ex: RoutedExperts, x: torch.Tensor, decision: RoutingDecision) -> torch.Tensor:
    """Σ_k w[b, k] · expert_{ids[b, k]}(x[b]) for x [B, D], every (row, choice) read in place."""
    ids, w = decision.topk_ids, decision.topk_weights  # [B, K]
    if ex.int8_stacks is not None:
        return _int8_experts(ex, x, ids, w)
    if ex.kernels == (TILES, TILES):
        experts_tiles = ops.op("moekit", "experts_tiles")
        h = experts_tiles(x[:, None, :], ex.gate_up, ids)  # [B, K, 2F]
    elif _has_gemv():
        kind = ops.kind_of(ex.gate_up)
        h = _op(ex.gate_up, "experts_gemv")(_widened(x, kind)[:, None, :], ex.gate_up, ids, _grouped(kind)).to(x.dtype)  # [B, K, 2F]
    else:
        h = (x[:, None, None, :] * ex.gate_up[ids]).sum(-1)  # indirect reads when compiled, no copy
    if ex.gate_up_bias is not None:
        h = h + ex.gate_up_bias[ids]
    a = ex.act(h)  # [B, K, F]
    if ex.kernels == (TILES, TILES):
        y = experts_tiles(a, ex.down, ids)  # [B, K, D]
    elif _has_gemv():
        kind = ops.kind_of(ex.down)
        y = _op(ex.down, "experts_gemv")(_widened(a, kind), ex.down, ids, _grouped(kind)).to(a.dtype)  # [B, K, D]
    else:
        y = (a[:, :, None, :] * ex.down[ids]).sum(-1)
    if ex.down_bias is not None:
        y = y + ex.down_bias[ids]
    return (y * w[..., None].to(y.dtype)).sum(1)  # [B, D]


def _int8_experts(ex: RoutedExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """_experts with q8_0 expert stacks (moekit::experts_q8); biases are at the engine dtype."""
    gate_up, down = ex.int8_stacks
    experts_q8, grouped = _op(gate_up, "experts_q8"), _grouped("q8_0")
    h = experts_q8(x[:, None, :], gate_up, ids, grouped)  # [B, K, 2F]
    if ex.gate_up_bias is not None:
        h = h + ex.gate_up_bias[ids]
    y = experts_q8(ex.act(h), down, ids, grouped)  # [B, K, D]
    if ex.down_bias is not None:
        y = y + ex.down_bias[ids]
    return (y * w[..., None].to(y.dtype)).sum(1)  # [B, D]


def _moe(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, RoutingDecision]:
    router = moe.router
    logits = _project(router, x.to(router.weight.dtype)).float()  # [B, E]
    bias = router.selection_bias.float() if router.selection_bias is not None else None
    decision = route(logits, router.spec, bias)
    out = _experts(moe.experts, x, decision)
    if moe.shared is not None:
        shared = _mlp(moe.shared, x)
        if moe.shared_gate is not None:
            shared = torch.sigmoid(linear_rows(x, moe.shared_gate.weight)) * shared
        out = out + shared
    return out, decision


def _attention(attn: Attention, x, stack, at, slot, cos, sin_signed, visible) -> torch.Tensor:
    """x [B, D] at each row's slot [B] → [B, D]; writes k, v into stack[at], stack[at + 1] (the
    cache's [N, B_max, Hkv, S, hd]). visible [B, S] bool: the real slots up to each row's own."""
    b = x.shape[0]
    h, hkv, hd = attn.heads, attn.kv_heads, attn.head_dim
    qkv = _project(attn.qkv, x)  # [B, (H + 2·Hkv)·hd]
    if attn.spec.qk_norm == "full":
        q, k, v = qkv.split(attn.split, dim=-1)
        qkv = torch.cat((attn.q_norm(q), attn.k_norm(k), v), dim=-1)
    if attn.clip_qkv is not None:
        qkv = qkv.clamp(-attn.clip_qkv, attn.clip_qkv)
    qkv = qkv.view(b, h + 2 * hkv, hd)
    qk, v = qkv[:, : h + hkv], qkv[:, h + hkv :]
    if attn.spec.qk_norm == "head":
        qk = attn.qk_norm_weight * rms_normalize(qk, attn.q_norm.eps)
    rot = cos.shape[-1]
    turned = qk[..., :rot] * cos + qk[..., :rot].roll(rot // 2, dims=-1) * sin_signed
    qk = turned if rot == hd else torch.cat((turned, qk[..., rot:]), dim=-1)
    q, k = qk[:, :h], qk[:, h:]
    rows = torch.arange(b, device=x.device)[:, None]
    heads = torch.arange(hkv, device=x.device)[None, :]
    # In place on the whole stack (a write through a view of it makes the graph copy the cache).
    stack.index_put_((torch.full_like(rows, at), rows, heads, slot[:, None]), k)
    stack.index_put_((torch.full_like(rows, at + 1), rows, heads, slot[:, None]), v)
    end = visible.shape[1]
    allowed = visible
    if attn.window is not None:
        back = slot[:, None] - torch.arange(end, device=x.device)[None, :]  # [B, S] how far back
        allowed = visible & (back < attn.window)
    keys, values = stack[at, :b, :, :end], stack[at + 1, :b, :, :end]  # [B, Hkv, S, hd]
    grouped = q.reshape(b, hkv, h // hkv, hd).float()  # [B, Hkv, G, hd]
    if attn.sinks is None and _has_attend():
        # The cache read in place; the graph's own attention widened it to fp32 copies every layer.
        out = ops.op("moekit", "attend")(grouped, keys, values, allowed, attn.scale).to(x.dtype)  # [B, Hkv, G, hd]
        return _project(attn.o_proj, out.reshape(b, h * hd))
    product = contract if b == 1 else torch.einsum
    logits = product("bkgd,bksd->bkgs", grouped, keys.float()) * attn.scale  # [B, Hkv, G, S]
    logits = logits.masked_fill(~allowed[:, None, None, :], float("-inf"))
    if attn.sinks is not None:
        sink = attn.sinks.float().view(1, hkv, h // hkv, 1).expand(b, hkv, h // hkv, 1)
        probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    out = product("bkgs,bksd->bkgd", probs, values.float()).to(x.dtype)  # [B, Hkv, G, hd]
    return _project(attn.o_proj, out.reshape(b, h * hd))


def _latent_attention(attn: MLAttention, x, stack, at, slot, cos, sin_signed, visible) -> torch.Tensor:
    """MLA's absorbed decode (moekit.model.mla) on x [B, D] → [B, D]; writes each row's latent and
    rope key into stack[at] (the cache's [N, B_max, S, R+Rr]) at its slot."""
    b = x.shape[0]
    h, nope, rr, r = attn.heads, attn.nope, attn.rope_dim, attn.latent_dim
    q, kv = _project(attn.x_proj, x).split(attn.x_split, dim=-1)
    if attn.q_lora_rank is not None:
        q = _project(attn.q_b_proj, attn.q_a_layernorm(q))
    q = q.view(b, h, nope + rr)
    latent, k_rope = kv.split([r, rr], dim=-1)
    turn = torch.cat((q[..., nope:], k_rope[:, None]), dim=1)  # [B, H+1, Rr]: the heads and the shared key
    if attn.interleaved:
        turn = turn.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    turned = turn * cos + turn.roll(rr // 2, dims=-1) * sin_signed
    new = torch.cat((attn.kv_a_layernorm(latent), turned[:, h]), dim=-1)  # [B, R+Rr]
    rows = torch.arange(b, device=x.device)
    stack.index_put_((torch.full_like(rows, at), rows, slot), new)
    # The absorbed projections have no cache length in them: contract at any batch. As a bmm at
    # bf16 each was ~60 µs (oneDNN) for a few hundred thousand products; a bf16 batch-8 step 7% faster.
    absorbed = contract("bhn,hnr->bhr", q[..., :nope], attn.w_uk)  # [B, H, R]
    query = torch.cat((absorbed, turned[:, :h]), dim=-1).float()  # [B, H, R+Rr]
    cached = stack[at, :b, : visible.shape[1]]  # [B, S, R+Rr]
    if _has_latent_attend():
        # The cache read in place, (row, head) pairs on both threads; Inductor's loops for the
        # same ran on one (1.5 µs per cached position per layer on deepseek_v3-1b at bf16).
        out = ops.op("moekit", "latent_attend")(query, cached, visible, attn.scale, r).to(x.dtype)
    else:
        cached = cached.float()
        product = contract if b == 1 else torch.einsum
        scores = product("bhc,bsc->bhs", query, cached) * attn.scale  # [B, H, S]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = product("bhs,bsr->bhr", probs, cached[..., :r]).to(x.dtype)  # [B, H, R]
    out = contract("bhr,hrv->bhv", out, attn.w_uv_t)  # [B, H, Dv]
    return _project(attn.o_proj, out.reshape(b, h * attn.v_dim))


def _step(decoder, ids, slot, positions, key_mask, stack, cos_table, sin_table):
    """ids, slot, positions [B] int64; key_mask [B, S] (False at padding; S = the last slot + 1);
    stack: the cache's tensors as one (KVCache.stack: k, v per attention layer, one per MLA layer)
    → (logits [B, V] fp32, topk_ids [L_moe, B, K], topk_weights [L_moe, B, K])."""
    spec = decoder.spec
    end = key_mask.shape[1]
    visible = key_mask & (torch.arange(end, device=ids.device)[None, :] <= slot[:, None])  # [B, S]
    x = decoder.embed.weight[ids]  # [B, D]
    if spec.multipliers.embedding != 1.0:
        x = x * spec.multipliers.embedding
    cos = cos_table[positions][:, None, :].to(x.dtype)  # [B, 1, rot]
    sin_signed = sin_table[positions][:, None, :].to(x.dtype)
    residual = spec.multipliers.residual
    chosen, weights = [], []
    at = 0  # the layer's first tensor in the stack
    for block in decoder.layers:
        latent = isinstance(block.attn, MLAttention)
        mixer = _latent_attention if latent else _attention
        h = mixer(block.attn, block.input_norm(x), stack, at, slot, cos, sin_signed, visible)
        at += 1 if latent else 2
        x = x + (h * residual if residual != 1.0 else h)
        h = block.post_norm(x)
        if isinstance(block.ffn, MoE):
            h, decision = _moe(block.ffn, h)
            chosen.append(decision.topk_ids)
            weights.append(decision.topk_weights)
        else:
            h = _mlp(block.ffn, h)
        x = x + (h * residual if residual != 1.0 else h)
    x = decoder.norm(x)
    if decoder.lm_head is None:  # tied: the embedding table, in the Hub layout
        logits = linear_rows(x, decoder.embed.weight, decoder.head_bias)
    else:
        logits = _project(decoder.lm_head, x)
    if spec.multipliers.logits_scaling != 1.0:
        logits = logits / spec.multipliers.logits_scaling
    return logits.float(), torch.stack(chosen), torch.stack(weights)


def unsupported(decoder) -> Optional[str]:
    """Why this decoder's decode step cannot be compiled here, or None when it can."""
    if decoder.device.type != "cpu":
        return "the compiled decode step is built and tested for CPU only"
    if any(isinstance(m, Linear) and m.kernel not in (PLAIN, TILES, INT8, INT8_GEMV) for m in decoder.modules()):
        return "projections are not in the Hub layout (FP8 kept packed, or laid out for eager kernels)"
    if any(isinstance(m, Linear) and m.kernel is not PLAIN for m in decoder.modules()) and not _has_gemv():
        return "int8 weights need the gemv operators, which this process has not loaded (--kernels reference, or their build failed)"
    for block in decoder.layers:
        if block.before_attn is not None or block.before_ffn is not None:
            return "a prefetcher is attached (the expert store)"
        attn = block.attn
        if isinstance(attn, MLAttention):
            if attn.x_proj is None:
                return "latent attention is not prepared (its fused projection is missing)"
        elif not isinstance(attn, Attention):
            return f"{type(attn).__name__} layers are not in the compiled step yet"
        elif (attn.spec.chunk_size is not None or attn.spec.qk_norm == "l2" or not attn.spec.use_rope
                or attn.spec.query_temperature is not None):
            return "llama4-style attention is not in the compiled step yet"
        for norm in (block.input_norm, block.post_norm):
            if not isinstance(norm, (RMSNorm, LayerNorm)):
                return f"{type(norm).__name__} is not in the compiled step"
        if isinstance(block.ffn, MoE):
            ex = block.ffn.experts
            if ex.offloaded or ex.store is not None:
                return "routed experts are paged by the expert store"
            if ex.weigh_input:
                return "experts weighed on their input (llama4) are not in the compiled step yet"
            if ex.expert_kernels is not None or (ex.kernels not in ((PLAIN, PLAIN), (TILES, TILES)) and ex.int8_stacks is None):
                return "routed experts are not in the Hub layout (MXFP4/FP8 kept packed, or eager kernels)"
            if ex.int8_stacks is not None and not _has_gemv():
                return "int8 experts need the gemv operators, which this process has not loaded (--kernels reference, or their build failed)"
    rope = decoder.rope.spec
    if rope.interleaved or rope.fp32:
        return "interleaved or fp32 RoPE is not in the compiled step yet"
    return None


def _mark_step(ids, slot, positions, key_mask) -> None:
    """Mark the batch and the visible length of one step's inputs as dynamic sizes."""
    mark = mark_dynamic
    if ids.shape[0] > 1:  # a size of 1 is always specialised; batch 1 gets its own graph
        for t in (ids, slot, positions, key_mask):
            mark(t, 0)
    if key_mask.shape[1] > 1:
        mark(key_mask, 1)


def _mark_held(stack, tables) -> None:
    """Mark the cache's rows and slots and the rope tables' length as dynamic sizes. A mark stays on
    its tensor, so these, which live across steps, are marked once (CompiledStep._held)."""
    mark = mark_dynamic
    for t in tables:
        mark(t, 0)
    if stack.shape[1] > 1:
        mark(stack, 1)
    mark(stack, 2 if stack.dim() == 4 else 3)  # the slots: MLA's [N, B, S, R+Rr], attention's [N, B, Hkv, S, hd]


class _Recorder:
    """The step's Dynamo backend: Inductor, as torch.compile's default, with each graph handed to the
    step to record. It holds the step weakly: Dynamo keeps every backend it was given for the life of
    the process (torch._dynamo.eval_frame.cached_backends), and the step holds its decoder's weights."""

    def __init__(self, step: "CompiledStep"):
        self._step = weakref.ref(step)
        self._inductor = step._inductor

    def __call__(self, gm, example_inputs):
        run = compile_fx(gm, example_inputs, config_patches=self._inductor)
        step = self._step()
        if step is not None:
            step._record(gm, example_inputs, run)
        return run


@dataclass
class StepResult:
    logits: torch.Tensor  # [B, 1, V] fp32
    chosen: torch.Tensor  # [L_moe, B, K] the experts each MoE layer chose
    weights: torch.Tensor  # [L_moe, B, K] their weights
    moe_layers: list  # the decoder's index of each MoE layer

    @property
    def decisions(self) -> list:
        """(layer index, RoutingDecision) per MoE layer; built only when a caller asks (the metered
        runs), so an unmetered step pays nothing for it."""
        pairs = zip(self.moe_layers, self.chosen.unbind(0), self.weights.unbind(0))
        return [(layer, RoutingDecision(ids, w)) for layer, ids, w in pairs]


class CompiledStep:
    """The decoder's T = 1 step, compiled once per process (Inductor's cache makes later processes
    quicker: it keeps the generated code on disk). Call it where Decoder.forward would run T = 1."""

    def __init__(self, decoder, cpp_wrapper: bool = True):
        """cpp_wrapper: Inductor writes the code that calls the step's ~80 kernels in C++ instead of
        Python: +25% tokens/s on the ~140M qwen3_moe at 2 threads (measured), for a longer first
        compile (~35 s instead of ~8 s there). The kernels, and so the results, are the same."""
        reason = unsupported(decoder)
        if reason is not None:
            raise ValueError(f"cannot compile the decode step: {reason}")
        self.decoder = decoder
        lay_out_tiles(decoder)  # an AMX machine's bf16 weights, once, before tracing reads their kernels
        self.moe_layers = [i for i, block in enumerate(decoder.layers) if isinstance(block.ffn, MoE)]
        for kind in ops.KINDS:  # the operators are the command's to load (moekit.ops.load); where not, the reductions
            ops.variant(kind)  # chosen now (measured once per machine), not while Dynamo traces
            ops.widen_batch(kind)
        self._tables = None  # (the rope's cos table it was copied from, cos, sin_signed)
        self._marked = None  # a weak reference to the cache stack last marked (_held)
        # Sizes that change from call to call are marked dynamic (_mark_step, _mark_held): one graph
        # for batch 1, one for larger batches, whatever the cache length. Everything else (weights, heads, widths)
        # stays static, which is what lets Inductor vectorise the products.
        # Dynamo keeps its graphs, and its limit of 8 recompiles, per code object: a copy of _step's
        # code for each decoder keeps one model's graphs from counting against another's.
        own = types.FunctionType(_step.__code__.replace(), _step.__globals__, _step.__name__)
        # Guards on the decoder's modules are skipped (tensor inputs keep theirs): checking ~100
        # parameters' modules on every call cost ~0.7 ms a step here, and nothing replaces a module or
        # a parameter of a compiled decoder (a hot swap writes into the expert stacks in place).
        self._inductor = {"cpp_wrapper": cpp_wrapper}
        if cpp_wrapper:  # the C++ calls the operators' C entry points, not the boxed dispatcher
            self._inductor["aot_inductor.custom_ops_to_c_shims"] = ops.c_shims()
        # Inductor compiles each graph through _Recorder, which hands it to _record to keep how to call it
        # again without Dynamo (moekit.model.direct_graph): later steps whose inputs pass a recorded
        # graph's guards call it directly, the rest go through Dynamo.
        self._graphs: list[DirectGraph] = []
        self._tracing: Optional[tuple] = None  # the per-call inputs of the call Dynamo may be compiling
        self.direct_steps = 0  # steps that called a recorded graph directly (the rest went through Dynamo)
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self._fn = torch.compile(own, backend=_Recorder(self), fullgraph=True, dynamic=False, options=options)

    def _record(self, gm, example_inputs, run) -> None:
        """Keep how to call `run` (just compiled from gm) without Dynamo, where that can be done."""
        if self._tracing is not None:
            graph = direct_graph(gm, example_inputs, run, self._tracing, held_tensors(self.decoder), outputs=3)
            if graph is not None:
                self._graphs.append(graph)

    def __call__(self, ids, cache, slot, positions, key_mask) -> StepResult:
        """ids [B, 1]; slot, positions [B] int64: where each row's token goes and its RoPE position
        (never past the slot, so below cache.max_len); key_mask [B, S] bool, False at padding (S =
        the last slot written + 1). The cache must be stacked (KVCache.stack; Decoder.new_cache's are)."""
        if cache.stack is None:
            raise ValueError("the compiled step needs a stacked cache (Decoder.new_cache makes one)")
        rope = self.decoder.rope  # its tables cover the cache: Decoder.new_cache reserved them
        # Dynamo guards on whether a tensor was made under inference mode: the small per-step inputs
        # and the rope tables are made so here, whoever the caller is, so one graph serves them all
        # (the caches are always normal tensors: Decoder.new_cache makes them outside it).
        with torch.inference_mode():
            tables = self._held(cache.stack, rope)
            ids, slot, positions, key_mask = (t.clone() for t in (ids[:, 0], slot, positions, key_mask))  # ids [B]
            inputs = (ids, slot, positions, key_mask, cache.stack, *tables)
            graph = next((g for g in self._graphs if g.accepts(inputs)), None)
            if graph is not None:
                if graph is not self._graphs[0]:  # the graph of the last call is tried first
                    self._graphs.remove(graph)
                    self._graphs.insert(0, graph)
                logits, chosen, weights = graph(inputs)
                self.direct_steps += 1
            else:
                _mark_step(ids, slot, positions, key_mask)
                self._tracing = inputs
                try:
                    logits, chosen, weights = self._fn(self.decoder, *inputs)
                finally:
                    self._tracing = None
        return StepResult(logits[:, None, :], chosen, weights, self.moe_layers)

    def _held(self, stack, rope) -> tuple:
        """The rope tables, and the stack and tables marked dynamic once each (marking them on every
        step cost ~0.1 ms, measured)."""
        if self._tables is None or self._tables[0] is not rope.cos_table:
            self._tables = (rope.cos_table, rope.cos_table.clone(), rope.sin_signed_table.clone())
            self._marked = None
        if self._marked is None or self._marked() is not stack:
            _mark_held(stack, self._tables[1:])
            self._marked = weakref.ref(stack)
        return self._tables[1:]

    def warm_up(self, batches: tuple[int, ...] = (1, 2)) -> None:
        """Compile the graphs now, on a scratch cache (batch 1, and 2 for every larger batch), so
        that no request waits for a compile and no timing includes one."""
        with torch.inference_mode():
            for b in batches:
                cache = self.decoder.new_cache(b, 4)
                slot = torch.ones(b, dtype=torch.int64, device=self.decoder.device)
                self(torch.zeros(b, 1, dtype=torch.int64, device=self.decoder.device), cache, slot, slot,
                     cache.key_mask[:, :2])

