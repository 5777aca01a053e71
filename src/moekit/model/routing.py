"""Expert choice: one `route()` runs every family; the family's order of operations is RouterSpec data.

Names follow Megatron-LM: router `logits` [T, E] → `scores` (softmax or sigmoid, what chooses) →
`topk_ids` [T, K] and `topk_weights` [T, K] (what combines the chosen experts' outputs).

Orders reproduced from transformers 5.24:
  score_then_topk + softmax  (mixtral, qwen*, olmoe): softmax(fp32) over E, top-K, / sum if normalize.
  score_then_topk + sigmoid  (deepseek_v3): sigmoid; selection_bias is added for CHOOSING only; group
      score = sum of the top-2 choice scores in each of n_group groups; experts outside the best
      topk_group groups are masked with -inf; top-K; weights = unbiased sigmoid scores of the chosen,
      / (sum + 1e-20) if normalize.
  topk_then_score (gpt_oss, granitemoe): top-K on the raw logits, softmax over those K;
      with sigmoid (llama4): top-K on the raw logits, each chosen one's sigmoid, no renormalising.
  sparsemixer (phimoe): K passes of "best free expert, weighed by a softmax over its near logits".
Every order ends with × scaling (routed_scaling_factor).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from moekit.errors import MoekitError
from moekit.spec.model_spec import RouterSpec


@dataclass
class RoutingDecision:
    topk_ids: Tensor  # [T, K] int64, tokens of all rows flattened row-major
    topk_weights: Tensor  # [T, K] float32, the weights that combine expert outputs
    entropy: Optional[Tensor] = None  # [T] nats of the full distribution, when watched (engine.router_health)


def _group_limited(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """choice [T, E] → the same with experts outside the best `topk_group` groups set to -inf."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, n_group, experts // n_group)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    drop = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, False)  # [T, G]
    return grouped.masked_fill(drop.unsqueeze(-1), float("-inf")).view(tokens, experts)


def _choose(scores: Tensor, spec: RouterSpec, selection_bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """scores [T, E] fp32 → (topk_ids [T, K], their scores or None when the choice was steered).

    The bias and the group limit steer the choice only; without them top-K's values are the scores.
    """
    steered = selection_bias is not None or (spec.n_group > 1 and spec.topk_group < spec.n_group)
    choice = scores + selection_bias if selection_bias is not None else scores
    if spec.n_group > 1 and spec.topk_group < spec.n_group:
        choice = _group_limited(choice, spec.n_group, spec.topk_group)
    values, ids = torch.topk(choice, k=spec.top_k, dim=-1)
    return ids, None if steered else values


def _score_then_topk(logits: Tensor, spec: RouterSpec, selection_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    scores = logits.sigmoid() if spec.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    topk_ids, weights = _choose(scores, spec, selection_bias)
    if weights is None:
        weights = scores.gather(1, topk_ids)  # [T, K] the unsteered scores of the chosen
    return topk_ids, _normalised(weights, spec)


def _normalised(weights: Tensor, spec: RouterSpec) -> Tensor:
    """[T, K] scores of the chosen → the family's combine weights (before routed scaling)."""
    if spec.normalize and spec.norm_p is not None:
        return weights / torch.norm(weights, p=spec.norm_p, dim=-1, keepdim=True)  # DBRX's p-norm
    if spec.normalize:
        # deepseek adds 1e-20 (sigmoid scores never sum to 0); the softmax families divide plainly
        eps = 1e-20 if spec.scoring == "sigmoid" else 0.0
        return weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return weights


def _topk_then_score(logits: Tensor, spec: RouterSpec) -> tuple[Tensor, Tensor]:
    top_logits, topk_ids = torch.topk(logits, spec.top_k, dim=-1)
    return topk_ids, _score_chosen(top_logits, spec)


def _score_chosen(top_logits: Tensor, spec: RouterSpec) -> Tensor:
    """[T, K] logits of the chosen → their weights: a softmax over the K (gpt_oss, granitemoe) or
    each one's own sigmoid (llama4, whose reference takes sigmoid of -inf, i.e. 0, for the rest)."""
    return top_logits.sigmoid() if spec.scoring == "sigmoid" else torch.softmax(top_logits, dim=-1)


def _sparsemixer(logits: Tensor, spec: RouterSpec) -> tuple[Tensor, Tensor]:
    """phimoe's eval-mode sparsemixer: K passes; each takes the best expert still free and weighs it
    by a softmax over the logits within 2·jitter_eps (relative) of it, the others masked out.
    Reference: transformers 5.24 `sparsemixer` (training=False), which makes two passes (K = 2)."""
    ids, weights = [], []
    free = logits  # [T, E]: the chosen ones become -inf
    for _ in range(spec.top_k):
        best, chosen = free.max(dim=-1, keepdim=True)  # [T, 1]
        factor = logits.abs().clamp(min=best)
        far = ((best - logits) / factor) > (2 * spec.jitter_eps)
        gates = torch.softmax(free.masked_fill(far, float("-inf")), dim=-1)
        ids.append(chosen)
        weights.append(gates.gather(-1, chosen))
        free = free.scatter(-1, chosen, float("-inf"))
    return torch.cat(ids, dim=-1), torch.cat(weights, dim=-1)


def route(logits: Tensor, spec: RouterSpec, selection_bias: Tensor | None = None) -> RoutingDecision:
    """logits [T, E] (made fp32 here: every reference scores in fp32) → RoutingDecision."""
    logits = logits.float()
    if spec.order == "topk_then_score":
        topk_ids, weights = _topk_then_score(logits, spec)
    elif spec.order == "sparsemixer":
        topk_ids, weights = _sparsemixer(logits, spec)
    else:
        topk_ids, weights = _score_then_topk(logits, spec, selection_bias)
    if spec.scaling != 1.0:
        weights = weights * spec.scaling
    return RoutingDecision(topk_ids=topk_ids, topk_weights=weights)


def routing_entropy(logits: Tensor, scoring: str = "softmax") -> Tensor:
    """logits [T, E] → [T] entropy (nats) of the router's full distribution over the E experts: a
    softmax's, or a sigmoid router's scores normalised to sum 1 (moekit.engine.router_health)."""
    logits = logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
        p = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        logp = p.clamp_min(1e-30).log()
    else:
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
    return -(p * logp).sum(dim=-1)  # [T]; a zero probability adds 0 (p × finite log)


def with_k(spec: RouterSpec, k: int) -> RouterSpec:
    """The family's rule with k experts per token; k above what DeepSeek's group limit leaves
    (topk_group groups of E/n_group) widens the limit to the fewest groups that hold k."""
    if spec.n_group > 1 and k > spec.topk_group * (spec.num_experts // spec.n_group):
        per_group = spec.num_experts // spec.n_group
        return replace(spec, top_k=k, topk_group=min(spec.n_group, -(-k // per_group)))
    return replace(spec, top_k=k)


def route_rows(logits: Tensor, spec: RouterSpec, selection_bias: Tensor | None, top_k: Sequence[int]) -> RoutingDecision:
    """Token t routed exactly as the family routes with K = top_k[t] (1 <= k <= the model's K).

    Fewer experts (or more: `with_k`) means the family's own rule over them: renormalised over the k kept where the
    family normalises (mixtral, qwen with norm_topk_prob, deepseek), the raw scores of the k kept
    where it does not (qwen without norm_topk_prob, olmoe), a softmax over k logits where top-K
    comes first (gpt_oss, granitemoe). Routing is row-wise, so each group of equal k is routed on
    its own. Rows narrower than the widest repeat their first expert at weight 0: the combine
    adds exactly nothing for them and reads no expert the row did not choose.
    """
    widths = sorted(set(int(k) for k in top_k))
    if len(widths) == 1:
        return route(logits, with_k(spec, widths[0]), selection_bias)
    tokens, width = logits.shape[0], widths[-1]
    ids = torch.empty((tokens, width), dtype=torch.int64, device=logits.device)  # [T, K]
    weights = torch.zeros((tokens, width), dtype=torch.float32, device=logits.device)  # [T, K]
    ks = torch.tensor([int(k) for k in top_k], device=logits.device)  # [T]
    for k in widths:
        rows = (ks == k).nonzero().squeeze(1)
        part = route(logits[rows], with_k(spec, k), selection_bias)
        ids[rows, :k] = part.topk_ids
        ids[rows, k:] = part.topk_ids[:, :1]
        weights[rows, :k] = part.topk_weights
    return RoutingDecision(topk_ids=ids, topk_weights=weights)


# --- inference-time routing policies ---------------------------------------------------------
# Each policy is data beside the family's exact route(), never the default. Fewer experts always
# means the family's own rule over the fewer (route_rows): renormalised over the k kept where the
# family normalises (mixtral, qwen/olmoe with norm_topk_prob, deepseek, then × routed scaling),
# the raw scores of the k kept where it does not, a softmax over k logits where top-K comes first
# (gpt_oss, granitemoe). A token's "top-1 share" is its first expert's weight over the sum of its
# K weights in the exact decision: the part of the combine that expert carries.


@dataclass(frozen=True)
class Exact:
    """`exact`: the family's routing (what the engine does without a policy)."""

    def __str__(self) -> str:
        return "exact"


@dataclass(frozen=True)
class TopK:
    """`topk:k` (or `topk`): k experts per token instead of the model's K; up to E (more than K widens)."""

    k: int

    def __str__(self) -> str:
        return f"topk:{self.k}"


@dataclass(frozen=True)
class Adaptive:
    """`adaptive:τ`: the top-1 expert alone when its share of the combine is >= τ, else all K."""

    tau: float

    def __str__(self) -> str:
        return f"adaptive:{self.tau:g}"


@dataclass(frozen=True)
class TopP:
    """`topp:p`: the fewest experts, in the family's order, whose combine shares sum to >= p (at most K)."""

    p: float

    def __str__(self) -> str:
        return f"topp:{self.p:g}"


@dataclass(frozen=True)
class Smooth:
    """`ema:α`: route each token on s_t = α·s_(t-1) + (1-α)·logits_t, the row's moving average of
    router logits (s_0 = the first token's logits); both the choice and the weights come from s_t."""

    alpha: float = 0.95

    def __str__(self) -> str:
        return f"ema:{self.alpha:g}"


@dataclass(frozen=True)
class Reuse:
    """`reuse`: when a token's top-1 expert equals the previous token's, it takes the previous
    token's experts (weighted by its own scores under the family's rule), else it routes exactly."""

    def __str__(self) -> str:
        return "reuse"


RoutingPolicy = Union[Exact, TopK, Adaptive, TopP, Smooth, Reuse]  # and moekit.model.routing_policies' knobs
POLICY_FORMS = ("exact, topk:k, adaptive:τ, topp:p, ema:α, reuse, temp:T, gumbel:σ[:seed], minconf:c, split:k:w, "
                "cache:N[:q], loadaware:Δ[:f[:decay]], capacity:f:drop|reroute, and P+reset:N")


def _number(text: str, value: str, example: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise MoekitError(f"routing policy {text!r}: {value!r} is not a number (e.g. {example})") from None
    if number != number:
        raise MoekitError(f"routing policy {text!r}: not a number (e.g. {example})")
    return number


def parse_policy(text: str, model_k: int, num_experts: Optional[int] = None) -> RoutingPolicy:
    """'topk:1', 'top1', 'adaptive:0.85', 'topp:0.9', 'ema:0.95', 'ema', 'reuse', 'exact' (and the
    knobs of moekit.model.routing_policies) -> the policy, checked against the model's K and E
    (topk above K widens; without E it stops at K); one line naming the problem otherwise."""
    from moekit.model import routing_policies

    if "+" in text:
        return routing_policies.parse_combined(text, model_k, num_experts)
    name, _, value = text.strip().lower().partition(":")
    if name.startswith("top") and name[3:].isdigit() and not value:
        name, value = "topk", name[3:]
    if name == "exact" and not value:
        return Exact()
    if name == "reuse" and not value:
        return Reuse()
    if name == "topk":
        if not value.strip().isdigit():
            raise MoekitError(f"routing policy {text!r}: topk needs a whole number of experts, e.g. topk:1")
        k, most = int(value), max(model_k, num_experts or model_k)
        if not 1 <= k <= most:
            raise MoekitError(f"routing policy {text!r}: k must be 1..{most} (the model routes {model_k} per token"
                              f"{f' of {num_experts} experts' if num_experts else ''})")
        return TopK(k)
    if name == "adaptive" and value:
        tau = _number(text, value, "adaptive:0.85")
        if tau <= 0:
            raise MoekitError(f"routing policy {text!r}: τ must be above 0 (above 1 never drops an expert)")
        return Adaptive(tau)
    if name == "topp" and value:
        p = _number(text, value, "topp:0.9")
        if not 0 < p <= 1:
            raise MoekitError(f"routing policy {text!r}: p must be in (0, 1]")
        return TopP(p)
    if name == "ema":
        alpha = _number(text, value, "ema:0.95") if value else 0.95
        if not 0 <= alpha < 1:
            raise MoekitError(f"routing policy {text!r}: α must be in [0, 1)")
        return Smooth(alpha)
    knob = routing_policies.parse_knob(text, name, value, model_k, num_experts)
    if knob is not None:
        return knob
    raise MoekitError(f"unknown routing policy {text!r}; the forms are {POLICY_FORMS}")


def top1_share(decision: RoutingDecision) -> Tensor:
    """[T] the first expert's weight over the sum of the token's weights."""
    weights = decision.topk_weights
    return weights[:, 0] / weights.sum(dim=-1).clamp_min(1e-30)


def policy_widths(decision: RoutingDecision, policy: RoutingPolicy) -> list[int]:
    """Experts per token that a stateless policy keeps of the exact decision (its prefix)."""
    k = decision.topk_ids.shape[1]
    if isinstance(policy, TopK):
        return [policy.k] * decision.topk_ids.shape[0]
    if isinstance(policy, Adaptive):
        return torch.where(top1_share(decision) >= policy.tau, 1, k).tolist()
    if isinstance(policy, TopP):
        shares = decision.topk_weights / decision.topk_weights.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        reached = shares.cumsum(dim=-1) >= policy.p  # [T, K]
        first = torch.where(reached.any(dim=-1), reached.float().argmax(dim=-1) + 1, k)
        return first.clamp(max=k).tolist()
    return [k] * decision.topk_ids.shape[0]


def weights_for(logits: Tensor, spec: RouterSpec, ids: Tensor) -> Tensor:
    """The family's combine weights [T, K] for experts `ids` [T, K] chosen some other way."""
    logits = logits.float()
    if spec.order == "sparsemixer":
        raise MoekitError("phimoe's sparsemixer weighs each expert by the passes that chose it: it has no rule "
                          "for experts chosen another way (reuse)")
    if spec.order == "topk_then_score":
        weights = _score_chosen(logits.gather(1, ids), spec)
    else:
        scores = logits.sigmoid() if spec.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        weights = _normalised(scores.gather(1, ids), spec)
    return weights * spec.scaling if spec.scaling != 1.0 else weights


@dataclass
class LayerState:
    """What a stateful policy remembers of one layer's last token, per row (None before the first)."""

    smoothed: Optional[Tensor] = None  # [B, E] moving average of the router logits
    top1: Optional[Tensor] = None  # [B] the exact top-1 expert
    ids: Optional[Tensor] = None  # [B, K] the experts the token used
    decisions: Optional[OrderedDict] = None  # cache:N's LRU, quantised router input → (ids [K], weights [K])
    penalty: Optional[Tensor] = None  # [E] loadaware's decaying logit penalty
    noise: Optional[torch.Generator] = None  # gumbel's seeded generator
    seen: int = 0  # tokens each row has routed through this layer (reset:N counts them)
    layer: int = 0

    def clear(self) -> None:
        """Forget what the row's past tokens left (reset:N); the noise stream and the count go on."""
        self.smoothed = self.top1 = self.ids = self.decisions = self.penalty = None


@dataclass
class PolicyStats:
    """Counters over one PolicyRun, all layers added (what serve's /metrics reads).

    routed      token × layer decisions the policy made
    cache_hits  of cache_lookups, decisions cache:N served from its LRU
    overflow    assignments beyond an expert's capacity in their step (capacity, loadaware: before the penalty)
    dropped     of those, assignments given weight 0 (capacity:f:drop, or reroute finding no expert with room)
    rerouted    of those, assignments moved to the token's next choice with room (capacity:f:reroute)
    penalised   assignments loadaware moved off the expert exact routing chose
    resets      times reset:N cleared a layer's state
    """

    routed: int = 0
    cache_lookups: int = 0
    cache_hits: int = 0
    overflow: int = 0
    dropped: int = 0
    rerouted: int = 0
    penalised: int = 0
    resets: int = 0


def _smooth(logits: Tensor, spec: RouterSpec, bias: Optional[Tensor], alpha: float, state: LayerState, rows: int):
    z = logits.float().view(rows, -1, logits.shape[-1])  # [B, T, E]
    out = torch.empty_like(z)
    s = state.smoothed
    for t in range(z.shape[1]):
        s = z[:, t] if s is None else alpha * s + (1 - alpha) * z[:, t]
        out[:, t] = s
    state.smoothed = s
    return route(out.view(-1, z.shape[-1]), spec, bias)


def _reuse(logits: Tensor, spec: RouterSpec, bias: Optional[Tensor], state: LayerState, rows: int):
    exact = route(logits, spec, bias)
    ids = exact.topk_ids.view(rows, -1, exact.topk_ids.shape[1]).clone()  # [B, T, K]
    top1 = ids[..., 0].clone()  # [B, T]
    prev_top1, prev_ids = state.top1, state.ids
    for t in range(ids.shape[1]):
        if prev_ids is not None:
            same = top1[:, t] == prev_top1
            ids[same, t] = prev_ids[same]
        prev_top1, prev_ids = top1[:, t], ids[:, t]
    state.top1, state.ids = prev_top1, prev_ids
    flat = ids.view(-1, ids.shape[-1])
    return RoutingDecision(topk_ids=flat, topk_weights=weights_for(logits, spec, flat))


def route_policy(logits: Tensor, spec: RouterSpec, selection_bias: Optional[Tensor], policy: RoutingPolicy,
                 state: Optional[LayerState] = None, rows: int = 1, inputs: Optional[Tensor] = None,
                 stats: Optional[PolicyStats] = None) -> RoutingDecision:
    """logits [B*T, E] of `rows` rows, row-major → the policy's decision. Stateful policies (ema,
    reuse, cache, loadaware) read and update `state` token by token in each row's order; the others
    need none. inputs [B*T, D]: the router's input (cache:N keys on it); stats: counters to add to."""
    from moekit.model import routing_policies

    if stats is not None and not isinstance(policy, routing_policies.KNOBS):
        stats.routed += logits.shape[0]  # the knobs count their own (reset:N's spans, each once)
    if isinstance(policy, routing_policies.KNOBS):
        return routing_policies.route_knob(logits, spec, selection_bias, policy,
                                           state if state is not None else LayerState(), rows, inputs,
                                           stats if stats is not None else PolicyStats())
    if isinstance(policy, Smooth):
        return _smooth(logits, spec, selection_bias, policy.alpha, state if state is not None else LayerState(), rows)
    if isinstance(policy, Reuse):
        return _reuse(logits, spec, selection_bias, state if state is not None else LayerState(), rows)
    exact = route(logits, spec, selection_bias)
    if isinstance(policy, Exact):
        return exact
    return route_rows(logits, spec, selection_bias, policy_widths(exact, policy))


class PolicyRun:
    """One policy applied over one batch of rows, with its per-layer state: owned by the caller
    (one per generation or scoring pass), handed to Decoder.forward(..., policy=run)."""

    def __init__(self, policy: RoutingPolicy, rows: int, ledger: Optional[dict[int, PolicyStats]] = None):
        """ledger: where the counters go, per layer (a server passes one per policy to total its
        requests' runs for /metrics); None: this run's own."""
        self.policy, self.rows = policy, rows
        self.states: dict[int, LayerState] = {}
        self.ledger: dict[int, PolicyStats] = {} if ledger is None else ledger

    @property
    def stats(self) -> PolicyStats:
        """The ledger's counters, all layers added."""
        total = PolicyStats()
        for layer in list(self.ledger.values()):
            for name, value in vars(layer).items():
                setattr(total, name, getattr(total, name) + value)
        return total

    def width(self, model_k: int) -> int:
        """Experts per token this run's decisions can hold (a decode step's width)."""
        from moekit.model.routing_policies import policy_width

        return policy_width(self.policy, model_k)

    def at(self, layer: int, rows: Optional[int] = None) -> "LayerPolicy":
        """rows: the rows this call routes together, when not the run's (a batch-level policy's run
        shared by a serve step's rows sees however many share it in that step)."""
        return LayerPolicy(self.policy, self.states.setdefault(layer, LayerState(layer=layer)), rows or self.rows,
                           self.ledger.setdefault(layer, PolicyStats()))


@dataclass
class LayerPolicy:
    """What one MoE layer's router needs: the policy, that layer's state, the rows of the batch."""

    policy: RoutingPolicy
    state: LayerState
    rows: int
    stats: PolicyStats = field(default_factory=PolicyStats)

    def route(self, logits: Tensor, spec: RouterSpec, selection_bias: Optional[Tensor],
              inputs: Optional[Tensor] = None) -> RoutingDecision:
        return route_policy(logits, spec, selection_bias, self.policy, self.state, self.rows, inputs, self.stats)
