"""The training loop: batches → train_forward → CE + router losses → AdamW (cosine, warmup, clipping).

Everything a step uses is a function of (seed, step) and the checkpointed state, so `--resume` from
step n and an uninterrupted run reach the same parameters.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moekit.train.aux_losses import expert_load, imbalance, router_entropy
from moekit.train.config import TrainConfig
from moekit.train.forward import RoutingOptions, train_forward
from moekit.train.state import RunFolder


def lr_at(step: int, base: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to `base` over `warmup` steps, then cosine down to base·min_ratio at `total`."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class StepResult:
    step: int
    loss: float  # cross-entropy, nats per token
    balance: float
    z: float
    grad_norm: float
    lr: float
    routings: list  # LayerRouting per MoE layer


def train_step(decoder, optimizer, cfg: TrainConfig, inputs, targets, step: int) -> StepResult:
    t = cfg.train
    gen = None
    if t.router_jitter > 0 or t.expert_dropout > 0:
        gen = torch.Generator(device=inputs.device).manual_seed(t.seed * 7_919 + step)
    options = RoutingOptions(capacity_factor=t.capacity_factor, jitter=t.router_jitter, expert_dropout=t.expert_dropout,
                             generator=gen)
    logits, routings = train_forward(decoder, inputs, options)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    balance = torch.stack([r.balance for r in routings]).mean() if routings else ce.new_zeros(())
    z = torch.stack([r.z for r in routings]).mean() if routings else ce.new_zeros(())
    loss = ce + t.aux_loss_coef * balance + t.z_loss_coef * z
    if t.entropy_coef != 0 and routings:
        loss = loss + t.entropy_coef * torch.stack([r.entropy for r in routings]).mean()
    lr = lr_at(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in decoder.parameters() if p.requires_grad], t.grad_clip if t.grad_clip > 0 else float("inf")
    )
    optimizer.step()
    if t.bias_balance_rate > 0:
        balance_selection_bias(decoder, routings, t.bias_balance_rate)
    return StepResult(step, ce.item(), balance.item(), z.item(), float(grad_norm), lr, routings)


def balance_selection_bias(decoder, routings, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free rule: raise the bias of underloaded experts, lower the overloaded."""
    from moekit.model.moe import MoE

    moes = [b.ffn for b in decoder.layers if isinstance(b.ffn, MoE)]
    with torch.no_grad():
        for moe, r in zip(moes, routings):
            load = expert_load(r.topk_ids, moe.experts.num_experts)
            moe.router.selection_bias.add_(rate * torch.sign(load.mean() - load))


def metrics_line(result: StepResult, tokens_per_s: float, elapsed: float) -> dict:
    layers = []
    for r in result.routings:
        load = expert_load(r.topk_ids, r.probs.shape[1])
        layers.append({
            "load": [round(x, 5) for x in load.tolist()],
            "imbalance": round(imbalance(load), 4),
            "load_cv": round(float(load.std(unbiased=False) / load.mean()), 4),
            "entropy": round(router_entropy(r.probs), 4),
            "dropped": round(1 - float(r.kept.float().mean()), 5),
        })
    return {
        "step": result.step + 1,  # steps completed
        "loss": round(result.loss, 5),
        "balance_loss": round(result.balance, 5),
        "z_loss": round(result.z, 5),
        "grad_norm": round(result.grad_norm, 4),
        "lr": result.lr,
        "tokens_per_s": round(tokens_per_s, 1),
        "elapsed_s": round(elapsed, 1),
        "imbalance": round(sum(x["imbalance"] for x in layers) / max(1, len(layers)), 4),
        "load_cv": round(sum(x["load_cv"] for x in layers) / max(1, len(layers)), 4),
        "entropy": round(sum(x["entropy"] for x in layers) / max(1, len(layers)), 4),
        "layers": layers,
    }


def append_metrics(run: RunFolder, line: dict) -> None:
    with run.file("metrics.jsonl").open("a") as fh:
        fh.write(json.dumps(line) + "\n")


def run_training(
    cfg: TrainConfig,
    run: RunFolder,
    decoder,
    optimizer,
    streams: dict,
    first_step: int,
    on_step: Callable[[int, dict | None], None] = lambda step, line: None,
    save: Callable[[int], None] = lambda step: None,
    stop_after: int | None = None,
) -> int:
    """Steps first_step .. cfg.train.steps-1 (or until `stop_after` steps are done); returns steps completed."""
    from moekit.train.data import batch_at, domain_weights

    t = cfg.train
    device = next(decoder.parameters()).device
    weights = domain_weights(streams, t.domain_mix)
    last = t.steps if stop_after is None else min(t.steps, stop_after)
    start_time = time.perf_counter()
    tokens = 0
    step = first_step
    for step in range(first_step, last):
        inputs, targets, _ = batch_at(streams, weights, t.seed, step, t.batch_size, t.seq_len)
        result = train_step(decoder, optimizer, cfg, inputs.to(device), targets.to(device), step)
        tokens += inputs.numel()
        done = step + 1
        line = None
        if done % t.log_every == 0 or done == last:
            elapsed = time.perf_counter() - start_time
            line = metrics_line(result, tokens / elapsed, elapsed)
            append_metrics(run, line)
        on_step(done, line)
        if done % t.checkpoint_every == 0 or done == last:
            save(done)
    return max(last, first_step)
