"""A trainable Decoder built from the run's config.json, initialised as transformers' _init_weights does.

Matrices and embeddings ~ normal(0, initializer_range), norm weights 1, biases and DeepSeek's
selection bias 0. Parameters are drawn in module order from one seeded generator, so a seed fixes
the initial model.
"""

from __future__ import annotations

import torch

from moekit.spec.loading import spec_from_config


def build_decoder(config: dict, seed: int, device: str = "cpu"):
    from moekit.model.decoder import Decoder
    from moekit.model.moe import Router

    spec = spec_from_config(config, "train")
    decoder = Decoder(spec, dtype=torch.float32, device=device)
    std = float(config.get("initializer_range", 0.02))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias") or name.endswith("selection_bias"):
                p.zero_()
            else:  # norm weights
                p.fill_(1.0)
    decoder.requires_grad_(True)
    for sub in decoder.modules():
        if isinstance(sub, Router) and sub.selection_bias is not None:
            sub.selection_bias.requires_grad_(False)  # moved by the balancing rule, not by gradients
    decoder.train()
    return decoder


def parameter_groups(decoder, weight_decay: float) -> list[dict]:
    """Decay matrices (and the embedding); never norms, biases or the selection bias."""
    decay, no_decay = [], []
    for _, p in decoder.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
