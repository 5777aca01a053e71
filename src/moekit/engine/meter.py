"""The activation meter: for every generated token, which experts it used and what that cost.

Counts come from the same ModelSpec the engine was built from, through `moekit.calc.params`
(one truth: the parameters the calculator counts are the parameters the engine touched).

Two per-token numbers, because vendors and physics disagree:
- `active_params`: what the calculator calls active (embedding table and head counted in full,
  the convention of Mistral and Qwen); `share` = active_params / total_params, exactly 1 for a
  dense model.
- `params_touched`: what the pass physically reads: ONE embedding row, not the table (a tied
  head already holds that row). `bytes_touched` = params_touched x bytes per element at the engine
  dtype, except routed experts when `expert_bytes` says what each one holds (int8 / int4 / MXFP4 /
  FP8 / paged mixed precisions: its real bytes). KV-cache reads are not included. `pass_bytes` is
  that rule, and the only place it is written: the meter, the serve scheduler's per-request usage
  and `moekit bench decode` all count through it, so they cannot disagree.

A token's routing is that of the forward pass that PRODUCED it: generated token 0 comes from the
last prompt position of the prefill, token i from the decode step that fed token i-1. Distinct
experts "so far" count everything the row's sequence routed to, prompt tokens included, since
all of those had to be resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from moekit.engine.generate import Generation, TokenRouting, token_routing
from moekit.spec.model_spec import ModelSpec


@dataclass(frozen=True)
class ParamsPerToken:
    """The spec's parameters split into what every token reads and what each routed expert adds."""

    fixed: int  # all layers' non-routed parts + final norm (no embedding, no head)
    expert_each: dict[int, int]  # MoE layer index -> params of one routed expert
    top_k: dict[int, int]  # MoE layer index -> K
    embedding_row: int  # D: what one token reads from the embedding table
    embedding_table: int  # V x D
    head: int  # V x D, 0 when tied to the embedding
    total_params: int

    def active(self, experts_per_layer: dict[int, int]) -> int:
        """Active params (embedding in full) for a token that used experts_per_layer[l] experts."""
        routed = sum(self.expert_each[l] * n for l, n in experts_per_layer.items())
        return self.fixed + routed + self.embedding_table + self.head

    def touched(self, experts_per_layer: dict[int, int], rows: int = 1) -> int:
        """Params physically read by a pass over `rows` tokens that used experts_per_layer[l]
        distinct experts: one embedding row per token, unless a tied head reads the table anyway."""
        routed = sum(self.expert_each[l] * n for l, n in experts_per_layer.items())
        embedding = rows * self.embedding_row if self.head else 0
        head = self.head if self.head else self.embedding_table
        return self.fixed + routed + embedding + head

    def typical(self) -> dict[int, int]:
        """Every MoE layer using its K experts."""
        return dict(self.top_k)


ExpertBytes = Callable[[int, int], int]  # (layer, expert) → the bytes that expert holds


def pass_bytes(counts: ParamsPerToken, chosen: Mapping[int, Iterable[int]], bytes_per_param: int,
               expert_bytes: Optional[ExpertBytes] = None, rows: int = 1, dense_saving: int = 0) -> int:
    """Bytes one pass over `rows` tokens read, MoE layer l having used the experts chosen[l]
    (repeats count once): params_touched at bytes_per_param, except that with expert_bytes each
    distinct chosen routed expert counts at its own bytes instead of its params at the dtype's, and
    dense_saving is what the other projections hold less than their params at the dtype (`--weights
    int8`: every pass reads them all, so it is one figure per engine, dense_saving_bytes)."""
    distinct = {layer: set(ids) for layer, ids in chosen.items()}
    held = (sum(counts.expert_each[layer] * len(ids) for layer, ids in distinct.items()) * bytes_per_param
            if expert_bytes is None else sum(expert_bytes(layer, e) for layer, ids in distinct.items() for e in ids))
    return pass_bytes_around(counts, distinct, bytes_per_param, held, rows, dense_saving)


def pass_bytes_around(counts: ParamsPerToken, distinct: Mapping[int, set], bytes_per_param: int, held: int,
                      rows: int = 1, dense_saving: int = 0) -> int:
    """pass_bytes with the routed experts' own bytes `held` already known (work_done's expert_bytes
    for the same experts: a decode step meters both and reads each expert's bytes once)."""
    params = counts.touched({layer: len(ids) for layer, ids in distinct.items()}, rows=rows)
    routed = sum(counts.expert_each[layer] * len(ids) for layer, ids in distinct.items())
    return (params - routed) * bytes_per_param + held - dense_saving


@dataclass(frozen=True)
class WorkDone:
    """What a request's tokens cost the machine, the basis of per-request "expert time" billing.

    expert_bytes: the bytes of the routed experts each token used, summed over tokens (a batch
    shares reads, so this is the request's share of the work, not of the memory traffic);
    expert_flops: 2 per multiply-add of those experts' weights; flops: expert_flops plus 2 per
    multiply-add of every other weight each token multiplies (the head for generated tokens only:
    a prefill computes the last position's logits). Attention's score arithmetic is not counted."""

    expert_bytes: int = 0
    expert_flops: int = 0
    flops: int = 0

    def __add__(self, other: "WorkDone") -> "WorkDone":
        return WorkDone(self.expert_bytes + other.expert_bytes, self.expert_flops + other.expert_flops,
                        self.flops + other.flops)

    def times(self, n: int) -> "WorkDone":
        """The work of n tokens that each did this."""
        return WorkDone(self.expert_bytes * n, self.expert_flops * n, self.flops * n)

    def as_dict(self) -> dict:
        return {"expert_bytes": self.expert_bytes, "expert_flops": self.expert_flops, "flops": self.flops}


def work_done(counts: ParamsPerToken, chosen: Mapping[int, Iterable[int]], bytes_per_param: int,
              expert_bytes: Optional[ExpertBytes] = None, dense_tokens: int = 0, head_tokens: int = 0) -> WorkDone:
    """The work of one token's routed experts chosen[l] (distinct ids per MoE layer), plus the
    non-expert weights of `dense_tokens` tokens and the output head of `head_tokens`."""
    params = sum(counts.expert_each[layer] * len(set(ids)) for layer, ids in chosen.items())
    held = params * bytes_per_param if expert_bytes is None else sum(
        expert_bytes(layer, e) for layer, ids in chosen.items() for e in set(ids))
    head = counts.head or counts.embedding_table  # a tied head multiplies by the embedding table
    dense = 2 * (counts.fixed * dense_tokens + head * head_tokens)
    return WorkDone(expert_bytes=held, expert_flops=2 * params, flops=2 * params + dense)


def dense_saving_bytes(decoder, bytes_per_param: int) -> int:
    """Bytes the decoder's quantized projections outside the routed experts (the uint8 q8_0 weights of
    `--weights int8`) hold less than their params at bytes_per_param; 0 when none is quantized."""
    import torch

    from moekit.model.linear import Linear

    saving = 0
    for sub in decoder.modules():
        if isinstance(sub, Linear) and sub.weight.dtype == torch.uint8:
            saving += sub.in_features * sub.out_features * bytes_per_param - sub.weight.numel()
    return saving


def params_per_token(spec: ModelSpec) -> ParamsPerToken:
    from moekit.calc.params import count_params, layer_params

    fixed = spec.final_norm.params(spec.hidden_size)
    expert_each: dict[int, int] = {}
    top_k: dict[int, int] = {}
    for index, layer in enumerate(spec.layers):
        c = layer_params(layer)
        fixed += c.always_on
        if layer.is_moe:
            expert_each[index] = c.expert_each
            top_k[index] = c.top_k
    table = spec.vocab_size * spec.hidden_size
    return ParamsPerToken(
        fixed=fixed,
        expert_each=expert_each,
        top_k=top_k,
        embedding_row=spec.hidden_size,
        embedding_table=table,
        head=0 if spec.tie_word_embeddings else table,
        total_params=count_params(spec).total_params,
    )


@dataclass(frozen=True)
class TokenActivation:
    row: int
    index: int  # position of this token among the row's generated tokens
    token_id: int  # the generated token
    position: int  # RoPE position of the pass that produced it
    experts: dict[int, list[int]]  # MoE layer -> chosen expert ids (router order)
    weights: dict[int, list[float]]  # MoE layer -> their combine weights
    active_params: int
    params_touched: int
    bytes_touched: int
    share: float  # active_params / total_params
    distinct_experts: dict[int, int]  # MoE layer -> distinct experts this row has used so far
    distinct_experts_total: int  # summed over layers

    def as_dict(self) -> dict:
        return {
            "row": self.row,
            "index": self.index,
            "token_id": self.token_id,
            "position": self.position,
            "experts": {str(k): v for k, v in self.experts.items()},
            "weights": {str(k): [round(w, 6) for w in v] for k, v in self.weights.items()},
            "active_params": self.active_params,
            "params_touched": self.params_touched,
            "bytes_touched": self.bytes_touched,
            "share": self.share,
            "distinct_experts": {str(k): v for k, v in self.distinct_experts.items()},
            "distinct_experts_total": self.distinct_experts_total,
        }


def _group_by_token(events: Iterable[TokenRouting]) -> Iterable[list[TokenRouting]]:
    """token_routing yields a token's layers consecutively; regroup them."""
    group: list[TokenRouting] = []
    for ev in events:
        if group and (ev.step, ev.row, ev.position) != (group[0].step, group[0].row, group[0].position):
            yield group
            group = []
        group.append(ev)
    if group:
        yield group


def meter(spec: ModelSpec, gen: Generation, bytes_per_param: int,
          expert_bytes: Optional[ExpertBytes] = None, dense_saving: int = 0) -> list[TokenActivation]:
    """Per generated token, row by row. A dense model (no MoE layer) still gets one entry per token.
    expert_bytes: (layer, expert) → the bytes that expert holds, when not params × bytes_per_param."""
    counts = params_per_token(spec)
    seen: dict[int, dict[int, set[int]]] = {row: {l: set() for l in counts.top_k} for row in range(len(gen.prompts))}
    found: dict[tuple[int, int], TokenActivation] = {}

    def record(row: int, index: int, position: int, layers: list[TokenRouting]) -> None:
        used = {ev.layer: len(set(ev.expert_ids)) for ev in layers}
        active = counts.active(used)
        touched = counts.touched(used)
        nbytes = pass_bytes(counts, {ev.layer: ev.expert_ids for ev in layers}, bytes_per_param, expert_bytes,
                            dense_saving=dense_saving)
        found[(row, index)] = TokenActivation(
            row=row,
            index=index,
            token_id=gen.token_ids[row][index],
            position=position,
            experts={ev.layer: ev.expert_ids for ev in layers},
            weights={ev.layer: ev.weights for ev in layers},
            active_params=active,
            params_touched=touched,
            bytes_touched=nbytes,
            share=active / counts.total_params,
            distinct_experts={l: len(s) for l, s in seen[row].items()},
            distinct_experts_total=sum(len(s) for s in seen[row].values()),
        )

    for layers in _group_by_token(token_routing(gen)):
        head = layers[0]
        for ev in layers:
            seen[head.row][ev.layer].update(ev.expert_ids)
        if head.generated_index is not None:
            record(head.row, head.generated_index, head.position, layers)

    if not counts.top_k:  # a dense model routes nothing: every token touches the same parameters
        for row, produced in enumerate(gen.token_ids):
            for index in range(len(produced)):
                record(row, index, len(gen.prompts[row]) + index - 1, [])
    elif len(found) != sum(len(t) for t in gen.token_ids):
        raise ValueError("meter needs the routing of every step: generate with record_routing=True")
    return [found[key] for key in sorted(found)]


def _decode_steps(counts: ParamsPerToken, gen: Generation) -> list[tuple[dict[int, set[int]], int]]:
    """Per decode step: (per MoE layer the union of the experts its running rows chose, rows)."""
    out = []
    for step in gen.routing[1:]:
        running = [r for r in range(len(gen.prompts)) if step.step < len(gen.token_ids[r])]
        if running:
            out.append(({lr.layer: {e for r in running for e in lr.topk_ids[r].tolist()} for lr in step.layers},
                        len(running)))
    if not out and not counts.top_k:  # dense, routing not recorded: every step reads the same
        out = [({}, len(gen.prompts))] * gen.timing.decode_steps
    return out


def decode_step_params(spec: ModelSpec, gen: Generation) -> list[int]:
    """Params one decode step reads for the whole batch: shared weights once, one embedding row per
    running row, and per MoE layer the union of the experts the rows chose (what a batch shares)."""
    counts = params_per_token(spec)
    return [counts.touched({l: len(ids) for l, ids in union.items()}, rows=rows)
            for union, rows in _decode_steps(counts, gen)]


def decode_step_bytes(spec: ModelSpec, gen: Generation, bytes_per_param: int,
                      expert_bytes: Optional[ExpertBytes] = None, dense_saving: int = 0) -> list[int]:
    """Bytes each decode step reads for the whole batch: decode_step_params, each expert at the
    bytes it holds (pass_bytes)."""
    counts = params_per_token(spec)
    return [pass_bytes(counts, union, bytes_per_param, expert_bytes, rows=rows, dense_saving=dense_saving)
            for union, rows in _decode_steps(counts, gen)]


def packed_expert_bytes(decoder) -> Optional[ExpertBytes]:
    """(layer, expert) → the bytes that resident expert holds, when the checkpoint's experts were
    kept packed (MXFP4 4.25 bits a weight, FP8 8.25: moekit.ops.packed_layout); None otherwise."""
    from moekit.model.experts import RoutedExperts

    each: dict[int, int] = {}
    for index, block in enumerate(decoder.layers):
        ex = getattr(block, "ffn", None)
        ex = getattr(ex, "experts", None)
        if isinstance(ex, RoutedExperts) and ex.kept_packed:
            biases = [b[0] for b in (ex.gate_up_bias, ex.down_bias) if b is not None]  # at the engine dtype
            each[index] = sum(w.numel() * w.element_size() for w in (*ex.resident_weights(0), *biases))
    if not each:
        return None
    return lambda layer, e: each[layer]
