"""Grouped-query attention over a preallocated KV cache: biases, q/k norms, sinks, sliding windows.

One module serves every MHA family; the AttentionSpec says which pieces a layer has:
  qk_norm "head" (qwen3): RMSNorm of head_dim on each head;  "full" (olmoe): RMSNorm over the whole
  q / k projection;  sinks (gpt_oss): one learned logit per head that takes part in the softmax and
  then is dropped;  sliding_window: keys more than `window - 1` slots back are masked;
  softmax_scale (granitemoe's attention_multiplier) replaces 1/sqrt(head_dim);
  llama4: chunk_size (a query sees only its own chunk of positions p // chunk), qk_norm "l2" (a
  weightless RMSNorm of each head AFTER RoPE), use_rope False (NoPE layers) with query_temperature.

Slots vs positions: a row's slot s is where its token sits in the cache; prompts are left-padded, so
its RoPE position (count of real tokens before it) can be smaller. Masks work on slots; RoPE on positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekit.model import step_ops
from moekit.model.linear import Linear
from moekit.model.norms import RMSNorm, rms_normalize
from moekit.model.rope import Rope, apply_rope_rolled
from moekit.spec.model_spec import AttentionSpec, NormSpec


def attention_mask(
    key_mask: torch.Tensor | None, start: int, length: int, window: int | None, device=None
) -> torch.Tensor:
    """key_mask [B, S] (S = start + length) → [B, 1, T, S] bool, True where query t may see key s.

    key_mask None means every slot is real (no padding): then the mask is [1, 1, T, S] on `device`.
    """
    total = start + length
    device = key_mask.device if key_mask is not None else device
    q_slot = torch.arange(start, start + length, device=device)[:, None]  # [T, 1]
    k_slot = torch.arange(total, device=device)[None, :]  # [1, S]
    allowed = k_slot <= q_slot
    if window is not None:
        allowed = allowed & (q_slot - k_slot < window)
    if key_mask is None:
        return allowed[None, None]
    # A pad query sees itself, so its row is never empty (an empty row would make NaN that a real row
    # could pick up through 0 × NaN); real queries are unaffected: their own slot is real.
    mask = (allowed[None] & key_mask[:, None, :]) | (k_slot == q_slot)[None]
    return mask[:, None]


def chunk_mask(positions: torch.Tensor, start: int, total: int, chunk: int) -> torch.Tensor:
    """llama4's chunked attention: positions [B, T] of the queries at slots start.. → [B, 1, T, S] bool,
    True where key slot s holds a position of the query's chunk (p // chunk).

    A row's real tokens fill consecutive slots, so the keys of query p's chunk are the p % chunk
    slots just before its own: the same test for a left-padded row as for one alone, as the
    reference's left-padding offset makes it."""
    length = positions.shape[1]
    q_slot = torch.arange(start, start + length, device=positions.device)[:, None]  # [T, 1]
    k_slot = torch.arange(total, device=positions.device)[None, :]  # [1, S]
    back = q_slot - k_slot  # [T, S] how many slots before the query
    return (back[None] <= (positions % chunk)[:, :, None])[:, None]  # [B, 1, T, S]


def row_attention_mask(
    key_mask: torch.Tensor | None, slot: torch.Tensor, end: int, window: int | None,
    chunk: int | None = None, position: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Continuous batching's decode mask: row r's one query sits at slot[r] and may see slots
    0..slot[r] (within the window, or within its chunk: the last position[r] % chunk slots).
    key_mask [B, end] (True up to each row's slot) or None when every row is at slot end-1.
    → [B, 1, 1, end] bool, or None when nothing is masked."""
    k_slot = torch.arange(end, device=slot.device)[None, :]  # [1, S]
    if window is not None and window < end:
        inside = k_slot > slot[:, None] - window
        key_mask = inside if key_mask is None else key_mask & inside
    if chunk is not None and end > chunk:
        inside = k_slot >= (slot - position % chunk)[:, None]  # [B, S]
        key_mask = inside if key_mask is None else key_mask & inside
    return None if key_mask is None else key_mask[:, None, None, :]


def query_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """llama4's NoPE-layer query scale [B, T] fp32, in the reference's order of operations."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def write_rows(cache: torch.Tensor, slot: torch.Tensor, values: torch.Tensor, slot_dim: int) -> None:
    """cache [B_max, ..., S_max, ...] (slots on `slot_dim`): row r's slot slot[r] ← values[r]."""
    rows = torch.arange(values.shape[0], device=slot.device)
    index = [rows] + [slice(None)] * (slot_dim - 1) + [slot]
    cache[tuple(index)] = values


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B, H, T, hd] → [B, Hkv, G*T, hd]: the G query heads sharing a kv head become one row block.

    Attention then runs per kv head without repeating keys and values (for T = 1 this is a view).
    """
    b, h, t, hd = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * t, hd)


def _grouped_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, 1, T, S] → [B, 1, G*T, S], matching `_grouped`'s row order (g major, t minor)."""
    b, _, t, s = mask.shape
    return mask.unsqueeze(2).expand(b, 1, groups, t, s).reshape(b, 1, groups * t, s)


def _attend_with_sinks(q, k, v, mask, scale, sinks):
    """Eager softmax with one extra per-head logit (the sink) that absorbs mass and carries no value.

    q [B, H, T, hd], k/v [B, Hkv, S, hd], mask [B, 1, T, S] → [B, H, T, hd].
    """
    b, h, t, hd = q.shape
    hkv = k.shape[1]
    logits = (_grouped(q, hkv) @ k.transpose(-1, -2)).view(b, h, t, -1) * scale  # [B, H, T, S]
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).view(1, h, 1, 1).expand(b, h, t, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]  # drop the sink
    out = probs.to(v.dtype).reshape(b, hkv, (h // hkv) * t, -1) @ v  # [B, Hkv, G*T, hd]
    return out.view(b, h, t, hd)


def _attend(q, k, v, mask, scale):
    """SDPA with the query heads grouped per kv head (CPU SDPA's own GQA path is far slower).

    q [B, H, T, hd], k/v [B, Hkv, S, hd], mask [B, 1, T, S] or None → [B, H, T, hd].
    """
    b, h, t, hd = q.shape
    hkv = k.shape[1]
    if mask is not None and h != hkv:
        mask = _grouped_mask(mask, h // hkv)
    out = F.scaled_dot_product_attention(_grouped(q, hkv), k, v, attn_mask=mask, scale=scale)
    return out.view(b, h, t, hd)


class Attention(nn.Module):
    """The mixer of an MHA/GQA layer (see moekit.model.decoder for the mixer interface)."""

    def __init__(self, spec: AttentionSpec, rope: Rope, norm: NormSpec, clip_qkv: float | None = None):
        super().__init__()
        self.spec = spec
        heads, kv_heads, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hd
        self.split = (heads * hd, kv_heads * hd, kv_heads * hd)
        # q, k and v fused: one GEMV per layer in decode instead of three.
        self.qkv = Linear(spec.hidden_size, sum(self.split), bias=spec.qkv_bias)
        self.o_proj = Linear(heads * hd, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(hd, norm.eps), RMSNorm(hd, norm.eps)
        elif spec.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(heads * hd, norm.eps), RMSNorm(kv_heads * hd, norm.eps)
        self.sinks = nn.Parameter(torch.empty(heads)) if spec.sinks else None
        self.scale = spec.softmax_scale if spec.softmax_scale is not None else hd**-0.5
        self.window = spec.sliding_window
        self.chunk = spec.chunk_size
        self.l2_eps = norm.eps if spec.qk_norm == "l2" else None  # llama4's weightless q/k norm
        self.clip_qkv = clip_qkv
        self.qk_norm_weight: torch.Tensor | None = None  # set by prepare()
        self._rope = (rope,)  # shared with every layer; the decoder owns it as a submodule

    def new_cache(self, batch: int, max_len: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def prepare(self) -> None:
        """After loading: stack the q and k head-norm weights so one op normalises every head."""
        if self.spec.qk_norm == "head":
            self.qk_norm_weight = self._stacked_qk_norm_weight()

    def _stacked_qk_norm_weight(self) -> torch.Tensor:
        hd = self.head_dim
        q_w, k_w = self.q_norm.weight, self.k_norm.weight
        return torch.cat((q_w.expand(self.heads, hd), k_w.expand(self.kv_heads, hd)))  # [H+Hkv, hd]

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] → qk [B, T, H+Hkv, hd] (normed, rotated), v [B, T, Hkv, hd].

        q and k heads stay side by side as the fused projection lays them out, so the head norm and
        RoPE run once over both instead of once each.
        """
        b, t, _ = x.shape
        h, hkv, hd = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(x)  # [B, T, (H + 2·Hkv)·hd]
        if self.spec.qk_norm == "full":
            q, k, v = qkv.split(self.split, dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        qkv = qkv.view(b, t, h + 2 * hkv, hd)
        qk, v = qkv[:, :, : h + hkv], qkv[:, :, h + hkv :]
        if self.spec.qk_norm == "head":
            weight = self.qk_norm_weight if self.qk_norm_weight is not None else self._stacked_qk_norm_weight()
            qk = weight * rms_normalize(qk, self.q_norm.eps)  # each head on its own, as q_norm / k_norm do
        if self.spec.use_rope:
            qk = self._rotate(qk, positions)
        if self.l2_eps is not None:
            # After RoPE, as llama4 does: a rotation keeps the norm only in exact arithmetic.
            qk = rms_normalize(qk, self.l2_eps)
        return qk, v

    def _rotate(self, qk: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope, hd = self._rope[0], self.head_dim
        dtype = torch.float32 if rope.fp32 else qk.dtype
        cos, sin_signed = rope.cos_sin_signed(positions, dtype)  # [B, T, 1, rot]
        x = qk.to(dtype)
        if rope.dim == hd:
            x = apply_rope_rolled(x, cos, sin_signed)
        else:  # partial rotary: only the first `rot` dims of each head turn
            x = torch.cat((apply_rope_rolled(x[..., : rope.dim], cos, sin_signed), x[..., rope.dim :]), dim=-1)
        return x.to(qk.dtype)

    def _tune(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, hd] × llama4's temperature of each query's position (fp32, cast back)."""
        if self.spec.query_temperature is None:
            return q
        scale = query_temperature(positions, *self.spec.query_temperature)  # [B, T]
        return (q * scale[:, None, :, None]).to(q.dtype)

    def forward(self, x, positions, layer_cache, start, key_mask) -> torch.Tensor:
        """x [B, T, D], positions [B, T], key_mask [B, start+T] or None (no padding) → [B, T, D];
        writes slots start..start+T-1. start may be a [B] tensor of per-row slots (T = 1): the
        decode step of continuous batching (see Decoder.forward_rows)."""
        b, t, _ = x.shape
        qk, v = self._project(x, positions)
        q = self._tune(qk[:, :, : self.heads].transpose(1, 2), positions)  # [B, H, T, hd]
        cache_k, cache_v = layer_cache
        if isinstance(start, torch.Tensor):
            k_new, v_new = qk[:, 0, self.heads :], v[:, 0]
            return self._forward_rows(q, k_new, v_new, cache_k, cache_v, start, key_mask, positions[:, 0])
        end = start + t
        cache_k[:, :, start:end].copy_(qk[:, :, self.heads :].transpose(1, 2))  # [B, Hkv, T, hd]
        cache_v[:, :, start:end].copy_(v.transpose(1, 2))
        keys, values = cache_k[:, :, :end], cache_v[:, :, :end]  # [B, Hkv, S, hd] views, no copy

        if self.sinks is not None:
            mask = attention_mask(key_mask, start, t, self.window, x.device)
            out = _attend_with_sinks(q, keys, values, mask, self.scale, self.sinks)
        else:
            plain = t == 1 and key_mask is None and (self.window is None or self.window >= end)
            plain = plain and (self.chunk is None or self.chunk >= end)
            mask = None if plain else attention_mask(key_mask, start, t, self.window, x.device)
            if self.chunk is not None and not plain:
                mask = mask & chunk_mask(positions, start, end, self.chunk)
            out = _attend(q, keys, values, mask, self.scale)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out)

    def _forward_rows(self, q, k, v, cache_k, cache_v, slot, key_mask, position) -> torch.Tensor:
        """q [B, H, 1, hd], k / v [B, Hkv, hd] of the new tokens, slot / position [B] → [B, 1, D]."""
        b = q.shape[0]
        write_rows(cache_k, slot, k, 2)
        write_rows(cache_v, slot, v, 2)
        end = int(slot.max()) + 1
        keys, values = cache_k[:b, :, :end], cache_v[:b, :, :end]  # [B, Hkv, S, hd] views
        mask = row_attention_mask(key_mask, slot, end, self.window, self.chunk, position)
        if self.sinks is not None:
            if mask is None:
                mask = torch.ones((b, 1, 1, end), dtype=torch.bool, device=q.device)
            out = _attend_with_sinks(q, keys, values, mask, self.scale, self.sinks)
        else:
            out = _attend(q, keys, values, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, 1, self.heads * self.head_dim))

    cache_tensors = 2  # k and v: this layer's tensors in the cache's stack (KVCache.stack)

    def decode(self, x, stack, at, slot, positions, cos, sin_signed, visible) -> torch.Tensor:
        """The decode step's form (moekit.model.step_ops): x [B, D] at each row's slot [B] and RoPE
        position [B] → [B, D]; writes k, v into stack[at], stack[at + 1] (the cache's
        [N, B_max, Hkv, S, hd]). cos, sin_signed [B, 1, rot] at each row's position, in the dtype
        the rotation runs in; visible [B, S] bool: the real slots up to each row's own."""
        b = x.shape[0]
        h, hkv, hd = self.heads, self.kv_heads, self.head_dim
        q, k, v = self._step_qkv(x, positions, cos, sin_signed)
        step_ops.write_slots(stack, at, slot, k)  # [B, Hkv, hd] at each row's slot
        step_ops.write_slots(stack, at + 1, slot, v)
        end = visible.shape[1]
        allowed = self._in_reach(visible, slot[:, None], positions[:, None])
        keys, values = stack[at, :b, :, :end], stack[at + 1, :b, :, :end]  # [B, Hkv, S, hd]
        grouped = q.reshape(b, hkv, h // hkv, hd)  # [B, Hkv, G, hd]
        if self.sinks is None:
            out = step_ops.attend(grouped, keys, values, allowed, self.scale)  # [B, Hkv, G, hd]
            return step_ops.project(self.o_proj, out.reshape(b, h * hd))
        product = step_ops.contract if b == 1 else step_ops.einsum
        logits = product("bkgd,bksd->bkgs", grouped.float(), keys.float()) * self.scale  # [B, Hkv, G, S]
        logits = logits.masked_fill(~allowed[:, None, None, :], float("-inf"))
        sink = self.sinks.float().view(1, hkv, h // hkv, 1).expand(b, hkv, h // hkv, 1)
        probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
        out = product("bkgs,bksd->bkgd", probs, values.float()).to(x.dtype)  # [B, Hkv, G, hd]
        return step_ops.project(self.o_proj, out.reshape(b, h * hd))

    def prefill(self, x, stack, at, slots, positions, cos, sin_signed, visible) -> torch.Tensor:
        """The prefill graph's form (moekit.model.prefill_step): the T tokens of each of B rows,
        x [B*T, D] row-major at slots [B, T] (consecutive) and RoPE positions [B*T] → [B*T, D];
        writes their k, v into stack[at], stack[at + 1] and attends over the row's slots, each
        query up to its own: visible [B, T, S] bool (causal, no padding, a pad query sees itself).
        Products, mask and softmax in fp32 as the compiled decode step's reference form."""
        b, t = slots.shape
        h, hkv, hd = self.heads, self.kv_heads, self.head_dim
        q, k, v = self._step_qkv(x, positions, cos, sin_signed)
        step_ops.write_tokens(stack, at, slots, k.view(b, t, hkv, hd))
        step_ops.write_tokens(stack, at + 1, slots, v.view(b, t, hkv, hd))
        end = visible.shape[2]
        allowed = self._in_reach(visible, slots[:, :, None], positions.view(b, t, 1))[:, None, None]  # [B, 1, 1, T, S]
        keys, values = stack[at, :b, :, :end].float(), stack[at + 1, :b, :, :end].float()  # [B, Hkv, S, hd]
        grouped = q.view(b, t, hkv, h // hkv, hd).float()  # [B, T, Hkv, G, hd]
        logits = torch.einsum("btkgd,bksd->bkgts", grouped, keys) * self.scale  # [B, Hkv, G, T, S]
        logits = logits.masked_fill(~allowed, float("-inf"))
        if self.sinks is None:
            probs = torch.softmax(logits, dim=-1)
        else:
            sink = self.sinks.float().view(1, hkv, h // hkv, 1, 1).expand(b, hkv, h // hkv, t, 1)
            probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("bkgts,bksd->btkgd", probs, values).to(x.dtype)  # [B, T, Hkv, G, hd]
        return step_ops.project(self.o_proj, out.reshape(b * t, h * hd))

    def _step_qkv(self, x, positions, cos, sin_signed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D], one token a row at RoPE positions [N] → q [N, H, hd], k, v [N, Hkv, hd]: the
        projection, norms and rotation of _project in the step's form (cos, sin_signed [N, 1, rot])."""
        n = x.shape[0]
        h, hkv, hd = self.heads, self.kv_heads, self.head_dim
        qkv = step_ops.project(self.qkv, x)  # [N, (H + 2·Hkv)·hd]
        if self.spec.qk_norm == "full":
            q, k, v = qkv.split(self.split, dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        qkv = qkv.view(n, h + 2 * hkv, hd)
        qk, v = qkv[:, : h + hkv], qkv[:, h + hkv :]
        if self.spec.qk_norm == "head":
            qk = self.qk_norm_weight * rms_normalize(qk, self.q_norm.eps)
        if self.spec.use_rope:
            rot, turn = cos.shape[-1], qk.to(cos.dtype)  # llama4 rotates in fp32 whatever the model dtype
            turned = (turn[..., :rot] * cos + turn[..., :rot].roll(rot // 2, dims=-1) * sin_signed).to(qk.dtype)
            qk = turned if rot == hd else torch.cat((turned, qk[..., rot:]), dim=-1)
        if self.l2_eps is not None:
            qk = rms_normalize(qk, self.l2_eps)  # after RoPE, as llama4 does (see _project)
        q, k = qk[:, :h], qk[:, h:]
        if self.spec.query_temperature is not None:
            scale = query_temperature(positions, *self.spec.query_temperature)  # [N] fp32
            q = (q * scale[:, None, None]).to(q.dtype)
        return q, k, v

    def _in_reach(self, visible, slot, positions) -> torch.Tensor:
        """visible [.., S] narrowed to this layer's window and llama4's chunk, for queries at slot
        [.., 1] and RoPE positions [.., 1]."""
        if self.window is None and self.chunk is None:
            return visible
        allowed = visible
        back = slot - torch.arange(visible.shape[-1], device=slot.device)  # [.., S] how many slots back
        if self.window is not None:
            allowed = allowed & (back < self.window)
        if self.chunk is not None:  # llama4: only the query's own chunk of positions (chunk_mask)
            allowed = allowed & (back <= positions % self.chunk)
        return allowed
