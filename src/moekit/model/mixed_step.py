"""A mixed step: the running rows' decode tokens and one chunk of a prompt in ONE forward (vLLM's
mixed batch), for the compiled step to capture.

Why: a long prompt is prefilled a chunk per scheduler step (chunked prefill), and as a forward of
its own each chunk re-reads every expert's weights that the step's decode forward reads again, and
pays a second graph's fixed cost: on the ~140M qwen3_moe fp32 beside 15 decode rows, 8-9 ms of a
step with a 128- or 33-token chunk (70.6 → 61.3 ms, 38.0 → 30.4; docs/BENCHMARKS.md "Mixed steps",
under load; the rest of a chunk's time is its tokens' compute, which is why the scheduler keeps the
chunk beside the rows small). Here the B decode rows' tokens and the
chunk's T tokens are the B + T rows of every projection, norm, router and expert product (each
module's `decode` form takes [N, D]; an expert chosen by any of them is read once); only attention
splits: the first B rows through the mixer's `decode` on the running rows' cache, the last T
through its `prefill` on the prompt's own one-row cache (a second stack), their outputs joined.

The separate forwards (decode_step, then prefill_step or the modules' forward) stay the reference:
tests/model/test_mixed_step.py holds the two to fp32 logits within 1e-4 and the same experts.
The scheduler (moekit.engine.scheduler) runs it where it applies (`takes`, and the decode rows at
the family's routing); anything else keeps the separate forwards, with the same tokens.
Legend: B decode rows, T the chunk's tokens, S the running rows' cache length (the last slot + 1),
P the prompt cache's length after the chunk, D hidden, V vocab.
"""

from __future__ import annotations

import torch

from moekit.model.decoder import FAMILY, StepRouting, step_outputs


def mixed_step(decoder, ids, slot, positions, key_mask, chunk_ids, chunk_positions, chunk_mask, stack, chunk_stack,
               cos_table, sin_table, routing: StepRouting = FAMILY):
    """ids, slot, positions [B] int64, key_mask [B, S] bool: the decode rows as decode_step takes
    them, over stack (the running rows' KVCache.stack); chunk_ids, chunk_positions [1, T] int64 and
    chunk_mask [1, P] bool: the chunk as prefill_step takes one row (it fills slots P-T..P-1 of
    chunk_stack, the prompt's own cache) → (logits [B + 1, V] fp32: the B rows', then the chunk's
    last token's; topk_ids [L_moe, B + T, K], topk_weights [L_moe, B + T, K], routing entropy
    [L_moe, B + T] where routing.entropy, else None): the decode rows' decisions, then the chunk's."""
    spec = decoder.spec
    b, t = ids.shape[0], chunk_ids.shape[1]
    end, filled = key_mask.shape[1], chunk_mask.shape[1]
    visible = key_mask & (torch.arange(end, device=ids.device)[None, :] <= slot[:, None])  # [B, S]
    slots = torch.arange(filled - t, filled, device=ids.device)[None, :]  # [1, T]
    keys = torch.arange(filled, device=ids.device)  # [P]
    # prefill_step's mask for one row: causal over its real slots; a pad query sees itself.
    seen = (chunk_mask[:, None, :] & (keys <= slots[..., None])) | (keys == slots[..., None])  # [1, T, P]
    flat = chunk_positions.reshape(-1)  # [T]
    x = decoder.embed.weight[torch.cat((ids, chunk_ids.reshape(-1)))]  # [B + T, D]
    if spec.multipliers.embedding != 1.0:
        x = x * spec.multipliers.embedding
    turn = torch.float32 if decoder.rope.fp32 else x.dtype  # the dtype RoPE rotates in
    every = torch.cat((positions, flat))  # [B + T]
    cos = cos_table[every][:, None, :].to(turn)  # [B + T, 1, rot]
    sin_signed = sin_table[every][:, None, :].to(turn)
    chosen, weights, entropy = [], [], []
    at = 0  # the layer's first tensor in each stack
    for block in decoder.layers:
        x, decision = block.mixed(x, b, stack, chunk_stack, at, slot, positions, visible, slots, flat, seen, cos,
                                  sin_signed, routing)
        at += block.attn.cache_tensors
        if decision is not None:
            chosen.append(decision.topk_ids)
            weights.append(decision.topk_weights)
            entropy.append(decision.entropy)
    last = decoder.norm(torch.cat((x[:b], x[-1:])))  # [B + 1, D]: the rows' and the chunk's last token
    return step_outputs(decoder, last, b + t, chosen, weights, entropy, routing)
