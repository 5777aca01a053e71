"""How tokens are generated: one prefill over the (left-padded) prompts, then one decode step per token.

The KV cache is allocated once for prompt + max_new_tokens; the decode loop writes into it and into
preallocated id/position buffers, so nothing grows while tokens are produced. Every forward pass
hands back its routing decisions (one `StepRouting` per pass), which the meter and the trace read.

Left padding keeps every row's newest token in the same cache slot, so one decode step serves the
whole batch; a row's RoPE positions count only its real tokens, so a padded row computes exactly
what it would compute alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from moekit.engine.sampling import SamplingParams, check_sampling, make_generator, next_tokens
from moekit.errors import MoekitError
from moekit.model.routing import PolicyRun

# on_token(step, ids): ids[r] is row r's new token, None once row r has stopped.
TokenCallback = Callable[[int, list[Optional[int]]], None]


@dataclass
class LayerRouting:
    layer: int
    topk_ids: Tensor  # [B*T, K] int64, rows of the forward's tokens flattened row-major
    topk_weights: Tensor  # [B*T, K] float32
    entropy: Optional[Tensor] = None  # [B*T] nats, when the routers were watched (engine.router_health)


@dataclass
class StepRouting:
    """The routing of one forward pass: step 0 is the prefill, step s > 0 the s-th decode step."""

    step: int
    tokens_per_row: int  # T of that forward: the padded prompt width at step 0, then 1
    layers: list[LayerRouting]


@dataclass
class Timing:
    prefill_s: float
    decode_s: float
    prompt_tokens: int  # real (non-pad) prompt tokens, all rows
    decode_steps: int  # forward passes after the prefill
    batch: int

    @property
    def decode_tokens(self) -> int:
        # Every row is computed at every step, finished or not: this is the work done.
        return self.decode_steps * self.batch

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "prompt_tokens": self.prompt_tokens,
            "decode_steps": self.decode_steps,
            "batch": self.batch,
            "decode_tokens": self.decode_tokens,
            "decode_tok_s": self.decode_tok_s,
            "prefill_tok_s": self.prefill_tok_s,
        }


@dataclass
class Generation:
    prompts: list[list[int]]
    token_ids: list[list[int]]  # generated ids per row; a stop token that ended the row is included
    routing: list[StepRouting]  # empty when routing was not recorded
    timing: Timing
    prompt_width: int = 0  # P: prompts are left-padded to this width
    stopped: list[bool] = field(default_factory=list)  # row ended on a stop token (not on the length)


@dataclass(frozen=True)
class TokenRouting:
    """One real token's pass through one MoE layer: the unit of the meter and the trace."""

    step: int
    row: int
    position: int  # RoPE position: real tokens before it in its row
    token_id: int  # the token fed in at this position
    generated_index: Optional[int]  # index into token_ids[row] of the token this pass produced, if any
    layer: int
    expert_ids: list[int]
    weights: list[float]
    entropy: Optional[float] = None  # of the router's full distribution, nats (None: not watched)


def check_request(prompts: Sequence[Sequence[int]], max_new_tokens: int, vocab_size: int, max_positions: int) -> None:
    """Refuse what cannot be generated, with one line the user can act on."""
    if max_new_tokens <= 0:
        raise MoekitError(f"max-new-tokens must be at least 1, got {max_new_tokens}")
    if not prompts:
        raise MoekitError("no prompt given")
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise MoekitError(f"prompt {row} is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise MoekitError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_positions:
        raise MoekitError(
            f"prompt ({longest} tokens) + max-new-tokens ({max_new_tokens}) exceeds the model's "
            f"context of {max_positions} positions"
        )


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """ids [B, P], real-token mask [B, P], RoPE positions [B, P] (pads get 0; they are masked out)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.int64)
        mask[row, width - len(prompt) :] = True
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, positions


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _routing(step: int, tokens_per_row: int, decisions: list) -> StepRouting:
    layers = [
        LayerRouting(layer=i, topk_ids=d.topk_ids.to("cpu", torch.int64), topk_weights=d.topk_weights.float().cpu(),
                     entropy=None if d.entropy is None else d.entropy.float().cpu())
        for i, d in decisions
    ]
    return StepRouting(step=step, tokens_per_row=tokens_per_row, layers=layers)


def generate(
    decoder,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: Sequence[int] = (),
    on_token: Optional[TokenCallback] = None,
    record_routing: bool = True,
    pad_id: int = 0,
    policy=None,
) -> Generation:
    """Generate up to max_new_tokens per prompt with `decoder` (the moekit.model.Decoder contract).

    policy: None for the family's routing, else a moekit.model.routing policy (topk:1, adaptive:0.85,
    ...); stateful ones (ema, reuse) carry their state from the prefill through every decode step."""
    spec = decoder.spec
    check_request(prompts, max_new_tokens, spec.vocab_size, spec.max_position_embeddings)
    check_sampling(sampling)
    prompts = [[int(t) for t in p] for p in prompts]
    batch = len(prompts)
    ids, mask, positions = left_pad(prompts, pad_id)
    width = ids.shape[1]

    cache = decoder.new_cache(batch, width + max_new_tokens)
    device = cache.key_mask.device
    cache.key_mask[:, :width] = mask.to(device)
    cache.key_mask[:, width:] = True  # generated tokens are real in every row
    generator = make_generator(sampling, device)
    stop = torch.tensor(sorted(set(int(s) for s in stop_ids)), dtype=torch.int64, device=device)
    stops = bool(stop.numel())  # with none, no row ever finishes: the loop skips the masking

    out = torch.zeros((batch, max_new_tokens), dtype=torch.int64, device=device)  # [B, max_new]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)  # [B]
    step_pos = (positions[:, -1:] + 1).to(device)  # [B, 1] next RoPE position per row
    step_ids = torch.zeros((batch, 1), dtype=torch.int64, device=device)  # [B, 1]
    routing: list[StepRouting] = []
    steps_done = 0
    routed = {} if policy is None else {"policy": PolicyRun(policy, batch)}

    with torch.inference_mode():
        _sync(device)
        start = time.perf_counter()
        decisions: Optional[list] = [] if record_routing else None
        logits = decoder(ids.to(device), cache, positions.to(device), decisions, last_only=True, **routed)  # [B, 1, V]
        token = next_tokens(logits[:, -1], sampling, generator)  # [B]
        out[:, 0] = token
        _sync(device)
        prefill_s = time.perf_counter() - start
        if decisions is not None:
            routing.append(_routing(0, width, decisions))
        if stops:
            finished |= torch.isin(token, stop)
        if on_token is not None:
            on_token(0, [int(t) for t in token.tolist()])

        start = time.perf_counter()
        for step in range(1, max_new_tokens):
            if stops and bool(finished.all()):
                break
            step_ids[:, 0] = token
            decisions = [] if record_routing else None
            logits = decoder(step_ids, cache, step_pos, decisions, **routed)  # [B, 1, V]
            token = next_tokens(logits[:, -1], sampling, generator)
            was_finished = finished.clone() if on_token is not None and stops else finished
            if stops:
                token = token.masked_fill(finished, pad_id)
                finished |= torch.isin(token, stop)
            out[:, step] = token
            step_pos += 1
            steps_done = step
            if decisions is not None:
                routing.append(_routing(step, 1, decisions))
            if on_token is not None:
                on_token(step, [None if f else int(t) for t, f in zip(token.tolist(), was_finished.tolist())])
        _sync(device)
        decode_s = time.perf_counter() - start

    token_ids, stopped = _trim(out[:, : steps_done + 1].tolist(), set(int(s) for s in stop_ids))
    timing = Timing(
        prefill_s=prefill_s,
        decode_s=decode_s,
        prompt_tokens=sum(len(p) for p in prompts),
        decode_steps=steps_done,
        batch=batch,
    )
    return Generation(prompts, token_ids, routing, timing, prompt_width=width, stopped=stopped)


def _trim(rows: list[list[int]], stop: set[int]) -> tuple[list[list[int]], list[bool]]:
    """Cut each row just after its first stop token."""
    kept, stopped = [], []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in stop), None)
        kept.append(row[:end] if end else row)
        stopped.append(end is not None)
    return kept, stopped


def token_routing(gen: Generation) -> Iterator[TokenRouting]:
    """Every real (non-pad) token's routing, step by step, row by row, layer by layer.

    Step s produced generated token s of each row still running; at the prefill every real prompt
    token is listed and the last one produced generated token 0.
    """
    for step in gen.routing:
        for row, prompt in enumerate(gen.prompts):
            produced = gen.token_ids[row]
            if step.step > 0 and step.step >= len(produced):
                continue  # row had stopped: this pass fed a pad
            if step.step == 0:
                first = gen.prompt_width - len(prompt)
                slots = range(first, gen.prompt_width)
            else:
                slots = range(1)
            for slot in slots:
                if step.step == 0:
                    position = slot - first
                    token_id = prompt[position]
                    is_last = slot == gen.prompt_width - 1
                else:
                    position = len(prompt) + step.step - 1
                    token_id = produced[step.step - 1]
                    is_last = True
                flat = row * step.tokens_per_row + slot
                for lr in step.layers:
                    yield TokenRouting(
                        step=step.step,
                        row=row,
                        position=position,
                        token_id=token_id,
                        generated_index=step.step if is_last else None,
                        layer=lr.layer,
                        expert_ids=lr.topk_ids[flat].tolist(),
                        weights=lr.topk_weights[flat].tolist(),
                        entropy=None if lr.entropy is None else float(lr.entropy[flat]),
                    )
