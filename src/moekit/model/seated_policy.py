"""A routing policy called from inside the decode step, as one opaque op per MoE layer.

Routing policies (moekit.model.routing, moekit.model.routing_policies) keep state in Python
between tokens (ema's running average, reuse's last experts, cache:N's LRU keyed by bytes,
capacity's greedy assignment, gumbel's generator), so no graph can hold them. The step calls each
MoE layer's policy as `moekit::seated_route(logits, inputs, bias, width, handle, layer)`: a custom
op that Dynamo leaves as a call and Inductor calls between its kernels; its fake says only "ids and
weights [B, width]". Everything else in the step (attention, the router's product, experts, head)
is the step's own code, eager or compiled, and the decision is the one the modules' forward makes
(the same policy object, called with the same logits and inputs), so the tokens are the forward's.

The policy of a step is the caller's (a PolicyRun for generate, a RowRouting for a server's rows):
the decoder seats it in its PolicySeat for the one step (`holding`), and the op finds the seat by
`handle` (an op's arguments are tensors and numbers, not Python objects), as
moekit.dist.graph_exchange finds its stores. A policy's decision can be narrower than the step's
width (adaptive keeps one expert where its share is high): it is padded to `width` with the row's
first expert at weight 0, which the combine adds as exactly nothing, as route_rows pads.

Legend: B rows of the step, D hidden, E experts, K experts per row (W: the step's width).
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from moekit.model.routing import RoutingDecision
from moekit.spec.model_spec import RouterSpec

_SEATS: "weakref.WeakValueDictionary[int, PolicySeat]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


class PolicySeat:
    """Where one decoder's decode step finds the routing policy of the step it is running."""

    def __init__(self, specs: dict[int, RouterSpec]):
        """specs: each MoE layer's router rule, by layer index."""
        self.specs = specs
        self.policy = None  # an object with .at(layer).route(logits, spec, bias, inputs), during a step
        self.handle = next(_HANDLES)
        _SEATS[self.handle] = self

    @contextmanager
    def holding(self, policy) -> Iterator[None]:
        """`policy` decides the routing of the steps run inside the with-block."""
        self.policy = policy
        try:
            yield
        finally:
            self.policy = None

    def route(self, layer: int, logits: torch.Tensor, inputs: torch.Tensor, bias: Optional[torch.Tensor],
              width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The seated policy's decision for `layer`, padded to `width` → (ids [B, W], weights [B, W])."""
        if self.policy is None:
            raise RuntimeError("moekit::seated_route: the step was given no routing policy (PolicySeat.holding)")
        decision = self.policy.at(layer).route(logits, self.specs[layer], bias, inputs)
        return padded(decision, width)


def padded(decision: RoutingDecision, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """decision [B, k] → (ids, weights) [B, width], new tensors: the k chosen, then the first expert
    again at weight 0 (the combine adds exactly nothing for it and reads no expert not chosen)."""
    ids, weights = decision.topk_ids, decision.topk_weights.float()
    pad = width - ids.shape[1]
    if pad < 0:
        raise RuntimeError(f"moekit::seated_route: the policy chose {ids.shape[1]} experts a token, more than the "
                           f"step's width {width}")
    return (torch.cat((ids, ids[:, :1].expand(-1, pad)), dim=1),
            torch.cat((weights, weights.new_zeros((weights.shape[0], pad))), dim=1))


def narrowed(decision: RoutingDecision) -> RoutingDecision:
    """An eager step's decision without its trailing columns that are padding in every row (the
    first expert again at weight 0): as wide as the modules' forward's decision, so the combine
    runs only the products the forward ran. Dropping a pad drops the addition of an exact zero."""
    ids, weights = decision.topk_ids, decision.topk_weights
    pads = (ids == ids[:, :1]) & (weights == 0)  # [B, W]
    pads[:, 0] = False
    live = (~pads).any(dim=0).nonzero()  # columns some row uses
    width = int(live[-1]) + 1 if live.numel() else 1
    if width == ids.shape[1]:
        return decision
    return RoutingDecision(ids[:, :width], weights[:, :width], decision.entropy)


@torch.library.custom_op("moekit::seated_route", mutates_args=())
def seated_route(logits: torch.Tensor, inputs: torch.Tensor, bias: Optional[torch.Tensor], width: int, handle: int,
                 layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, E] fp32, inputs [B, D] (the router's input), bias [E] (DeepSeek's selection bias) or
    None → (topk_ids [B, width] int64, topk_weights [B, width] fp32): the decision of the policy seated
    in the PolicySeat `handle` for MoE layer `layer`."""
    seat = _SEATS.get(handle)
    if seat is None:
        raise RuntimeError(f"moekit::seated_route: no decoder has the policy seat {handle} in this process")
    return seat.route(layer, logits, inputs, bias, width)


@seated_route.register_fake
def _(logits, inputs, bias, width, handle, layer):
    rows = logits.shape[0]
    return (logits.new_empty((rows, width), dtype=torch.int64), logits.new_empty((rows, width), dtype=torch.float32))
