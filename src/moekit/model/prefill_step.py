"""A prompt's prefill (T > 1 tokens a row) in the decode step's form, for the compiled step to capture.

Why: the eager forward (Decoder.forward_modules) runs a short prompt as ~2,000 small ops, and on a
CPU their fixed cost is most of a prefill's time, as it was of an eager decode step's; a served
request waits for it before its first token. Here the prompt's B×T tokens are the rows of the step's
products (each module's `decode` form: the projections, the router, the chosen experts read in place
by moekit::experts_gemv, which groups the rows that chose one expert so each is read once), and only
attention has a form of its own (Attention.prefill, MLAttention.prefill: each query sees its row's
slots up to its own). moekit.model.compiled_step compiles it as a graph of its own, with B, T and
the cache length dynamic, saved and reloaded as the step's graphs are.

The modules' forward stays the reference (tests/model/test_prefill_step.py holds the two to the same
greedy tokens and fp32 logits within 1e-4); the engine runs it where this form does not apply
(`takes`): a row's own K or a routing policy, a caller asking for every position's logits (prompt
logprobs), a store's or expert parallelism's hooks.
Legend: B rows, T tokens a row, S slots (the cache length after the prompt), D hidden, V vocab.
"""

from __future__ import annotations

from typing import Optional

import torch

from moekit.model.decoder import FAMILY, StepRouting, step_outputs
from moekit.model.expert_forms import Paged
from moekit.model.moe import MoE


def takes(decoder, top_k, policy, last_only: bool) -> Optional[str]:
    """Why a prefill with these options runs the modules' forward instead of this form, or None."""
    if not last_only:
        return "every position's logits asked for"
    if top_k is not None or policy is not None:
        return "a row's own K or a routing policy"
    if any(block.before_attn is not None or block.before_ffn is not None for block in decoder.layers):
        return "hooks on the blocks (an expert store's prefetch)"
    forms = [block.ffn.experts.held for block in decoder.layers if isinstance(block.ffn, MoE)]
    if any(isinstance(form, Paged) or form.compiles() is not None for form in forms):
        return "experts paged by a store, or laid out for the eager kernels"
    return None


def prefill_step(decoder, ids, positions, key_mask, stack, cos_table, sin_table, routing: StepRouting = FAMILY):
    """ids, positions [B, T] int64 (T > 1); key_mask [B, S] bool (False at left padding; the prompt
    fills slots S-T..S-1 of each row); stack: the cache's tensors as one (KVCache.stack) →
    (logits [B, V] fp32 of each row's last token, topk_ids [L_moe, B*T, K], topk_weights
    [L_moe, B*T, K], routing entropy [L_moe, B*T] where routing.entropy, else None)."""
    spec = decoder.spec
    b, t = ids.shape
    end = key_mask.shape[1]
    slots = torch.arange(end - t, end, device=ids.device)[None, :].expand(b, t)  # [B, T]
    keys = torch.arange(end, device=ids.device)  # [S]
    # Causal over the row's real slots; a pad query sees itself (attention.attention_mask says why).
    visible = (key_mask[:, None, :] & (keys <= slots[..., None])) | (keys == slots[..., None])  # [B, T, S]
    x = decoder.embed.weight[ids.reshape(-1)]  # [B*T, D]
    if spec.multipliers.embedding != 1.0:
        x = x * spec.multipliers.embedding
    flat = positions.reshape(-1)  # [B*T]
    turn = torch.float32 if decoder.rope.fp32 else x.dtype  # the dtype RoPE rotates in
    cos = cos_table[flat][:, None, :].to(turn)  # [B*T, 1, rot]
    sin_signed = sin_table[flat][:, None, :].to(turn)
    chosen, weights, entropy = [], [], []
    at = 0  # the layer's first tensor in the stack
    for block in decoder.layers:
        x, decision = block.prefill(x, stack, at, slots, flat, cos, sin_signed, visible, routing)
        at += block.attn.cache_tensors
        if decision is not None:
            chosen.append(decision.topk_ids)
            weights.append(decision.topk_weights)
            entropy.append(decision.entropy)
    last = decoder.norm(x.view(b, t, -1)[:, -1])  # [B, D]: only the last token's logits are asked for
    return step_outputs(decoder, last, b * t, chosen, weights, entropy, routing)
