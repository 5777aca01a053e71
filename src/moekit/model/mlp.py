"""Feed-forward blocks: the gated activation every family uses, and a dense MLP with gate/up fused.

Activations (MLPSpec.activation) on a fused [.., 2F] gate_up (gate in the first half, up in the second):
  silu / gelu / gelu_tanh:  act(gate) * up
  swiglu_oai (gpt_oss):     gate clamped above at `limit`, up clamped to ±limit,
                            (up + 1) * gate * sigmoid(alpha * gate)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moekit.model.linear import Linear
from moekit.model.step_ops import project
from moekit.spec.model_spec import MLPSpec

_PLAIN = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class Activation:
    kind: str = "silu"
    gated: bool = True
    limit: float = 7.0  # swiglu_oai only (gpt_oss's swiglu_limit)
    alpha: float = 1.702  # swiglu_oai only

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [.., 2F] (gated) or [.., F] → [.., F]."""
        if not self.gated:
            return _PLAIN[self.kind](h)
        gate, up = h.chunk(2, dim=-1)
        if self.kind == "swiglu_oai":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return _PLAIN[self.kind](gate) * up


def activation_for(spec: MLPSpec, extras: dict) -> Activation:
    return Activation(
        kind=spec.activation,
        gated=spec.gated,
        limit=float(extras.get("swiglu_limit", 7.0)),
        alpha=float(extras.get("swiglu_alpha", 1.702)),
    )


class MLP(nn.Module):
    """A dense feed-forward (llama-style layers, DeepSeek's first dense layers, shared experts)."""

    def __init__(self, spec: MLPSpec, act: Activation):
        super().__init__()
        self.width = spec.width
        self.gate_up = Linear(spec.hidden_size, (2 if spec.gated else 1) * spec.width, bias=spec.bias)
        self.down = Linear(spec.width, spec.hidden_size, bias=spec.bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """The decode step's form (moekit.model.step_ops): x [B, D] → [B, D]."""
        return project(self.down, self.act(project(self.gate_up, x)))
