"""Normalisation layers, with the reference's dtype handling: statistics in fp32, result cast back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekit.spec.model_spec import NormSpec


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32 and cast back: the reference's steps and their order.

    Written out rather than F.rms_norm, which on CPU runs as about ten small ops where this is five.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Cast back before the weight: the order llama/mixtral/qwen use, so bf16 rounds where theirs does.
        return self.weight * rms_normalize(x, self.eps)


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
