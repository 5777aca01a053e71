"""Normalisation layers, with the reference's dtype handling: statistics in fp32, result cast back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekit.spec.model_spec import NormSpec


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, then cast back before the weight: the order llama/mixtral/qwen use, so bf16
        # rounds where theirs does.
        # F.rms_norm computes x * rsqrt(mean(x²) + eps) in one kernel, bit for bit the reference's steps.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out = out.to(x.dtype) * self.weight
        return out + self.bias if self.bias is not None else out


def make_norm(spec: NormSpec, width: int) -> nn.Module:
    if spec.kind == "layer":
        return LayerNorm(width, spec.eps, spec.bias)
    return RMSNorm(width, spec.eps)
