"""The decoder every family runs: embed → L × (norm, mixer, norm, feed-forward) → norm → head.

A family differs only in what its ModelSpec says: which mixer (MHA/GQA or DeepSeek's MLA), which
feed-forward per layer (dense MLP or MoE), the multipliers (granitemoe), tied or untied head.

The mixer interface (Attention here, MLAttention in mla.py):
    mixer.new_cache(batch, max_len, dtype, device) -> object     # preallocated, never grown
    mixer.forward(x [B,T,D], positions [B,T], layer_cache, start, key_mask [B, start+T] or None) -> [B,T,D]
        # key_mask None: no slot is padding (the decoder checks once per forward, not per layer)
Modules are built on the meta device and materialised uninitialised: load_checkpoint fills them,
then lays every projection out for this device and dtype's fastest kernel (moekit.model.linear).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple, Optional

import torch
from torch import nn

from moekit.errors import SpecError
from moekit.model.attention import Attention
from moekit.model.cache import KVCache, stacked_layers
from moekit.model.experts import RoutedExperts
from moekit.model.linear import PLAIN, ROWS, Linear, kernel_for, prepare_linears
from moekit.model.mla import MLAttention
from moekit.model.mlp import MLP, activation_for
from moekit.model.moe import MoE, Router
from moekit.model.norms import make_norm
from moekit.model.rope import Rope, rotary_dim
from moekit.model.routing import RoutingDecision
from moekit.model.seated_policy import PolicySeat
from moekit.model.step_ops import linear_rows, project
from moekit.spec.model_spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec


def _mixer(layer: LayerSpec, rope: Rope, spec: ModelSpec) -> nn.Module:
    attn = layer.mixer
    if not isinstance(attn, AttentionSpec):
        raise SpecError(f"{spec.name}: {type(attn).__name__} mixers are not supported by the engine")
    if attn.kind == "mla":
        return MLAttention(attn, rope, interleaved=bool(spec.extra("rope_interleave", True)))
    return Attention(attn, rope, layer.norm, clip_qkv=spec.extra("clip_qkv"))


def _rope_width(spec: ModelSpec) -> int:
    attn = spec.layers[0].mixer
    if not isinstance(attn, AttentionSpec):
        raise SpecError(f"{spec.name}: the engine needs attention in layer 0")
    if attn.kind == "mla":
        return attn.qk_rope_head_dim
    return rotary_dim(attn.head_dim, spec.rope)


class StepRouting(NamedTuple):
    """What a decode step's routers do besides the family's routing at the model's K: the step's
    constants, so each combination is a compiled graph of its own (CompiledStep keys them)."""

    width: int = 0  # the decisions' width K when not the model's: a row's K past it, or a policy's width
    seated: bool = False  # the decoder's seated policy decides (moekit.model.seated_policy, one opaque op a layer)
    entropy: bool = False  # each decision carries its rows' routing entropy (router health)


class StepChoices(NamedTuple):
    """A decode step's routing as its graph returns it, whole, for a caller that reads every layer at
    once (the scheduler's meter: one tolist() a step, where a RoutingDecision per layer cost it ~0.1 ms
    of a ~4 ms step on the ~140M model; its Python runs cold after the graph)."""

    layers: list  # the decoder's index of each MoE layer
    chosen: torch.Tensor  # [L_moe, B, K] the experts each MoE layer chose for each row
    weights: torch.Tensor  # [L_moe, B, K] their weights
    entropy: Optional[torch.Tensor]  # [L_moe, B] routing entropy where the step was asked for it, else None

    def decisions(self) -> list:
        """(layer index, RoutingDecision) per MoE layer, as forward_rows' `decisions` gets them."""
        return step_decisions(self.layers, self.chosen, self.weights, self.entropy)


FAMILY = StepRouting()  # the family's routing at the model's K
WATCHED = StepRouting(entropy=True)  # the same, router health watching (Decoder.entropy_watched)
NOTHING_SEATED = nullcontext()  # a step without a policy holds no seat (nullcontext is reusable)


class Block(nn.Module):
    def __init__(self, layer: LayerSpec, rope: Rope, spec: ModelSpec):
        super().__init__()
        extras = dict(spec.extras)
        self.input_norm = make_norm(layer.norm, spec.hidden_size)
        self.attn = _mixer(layer, rope, spec)
        self.post_norm = make_norm(layer.norm, spec.hidden_size)
        if isinstance(layer.ffn, MLPSpec):
            self.ffn = MLP(layer.ffn, activation_for(layer.ffn, extras))
        else:
            self.ffn = MoE(layer.ffn, extras)
        self.residual = spec.multipliers.residual
        # Called with the residual stream before attention and before the feed-forward, when set:
        # the expert store's prefetcher guesses a coming layer's experts from it. A hook returns the
        # residual as given (decode goes on with it); `opaque` on it: the compiled step can call it.
        self.before_attn = None
        self.before_ffn = None

    def forward(self, x, positions, layer_cache, start, key_mask, top_k=None, policy=None, entropy=False):
        """x [B, T, D] → (x [B, T, D], RoutingDecision or None). start: the first slot written, an
        int, or per row a [B] tensor (T = 1, continuous batching); top_k: one K per token or None;
        policy: this layer's routing.LayerPolicy or None (the family's routing); entropy: the
        decision carries each token's routing entropy (router health)."""
        # x is the decoder's own running sum (never a caller's tensor): residual adds go in place.
        if self.before_attn is not None:
            self.before_attn(x)
        h = self.attn(self.input_norm(x), positions, layer_cache, start, key_mask)
        x.add_(h * self.residual if self.residual != 1.0 else h)
        if self.before_ffn is not None:
            self.before_ffn(x)
        h = self.post_norm(x)
        decision = None
        if isinstance(self.ffn, MoE):
            h, decision = self.ffn(h, top_k, policy, entropy)
        else:
            h = self.ffn(h)
        x.add_(h * self.residual if self.residual != 1.0 else h)
        return x, decision

    def decode(self, x, stack, at, slot, positions, cos, sin_signed, visible, top_k=None, routing=FAMILY):
        """The decode step's form of forward (moekit.model.step_ops): x [B, D] → (x [B, D],
        RoutingDecision or None); the mixer's cache is stack[at..] (see Attention.decode); top_k:
        None, or each row's K [B]; routing: the step's StepRouting (MoE.decode)."""
        return self._rows(x, lambda h: self.attn.decode(h, stack, at, slot, positions, cos, sin_signed, visible),
                          top_k, routing)

    def prefill(self, x, stack, at, slots, positions, cos, sin_signed, visible, routing=FAMILY):
        """The prefill graph's form (moekit.model.prefill_step): x [B*T, D], the T tokens of each
        of B rows at slots [B, T] → (x [B*T, D], RoutingDecision or None); see Attention.prefill."""
        return self._rows(x, lambda h: self.attn.prefill(h, stack, at, slots, positions, cos, sin_signed, visible),
                          None, routing)

    def mixed(self, x, b, stack, chunk_stack, at, slot, positions, visible, slots, flat, seen, cos, sin_signed,
              routing=FAMILY):
        """The mixed step's form (moekit.model.mixed_step): x [B + T, D], B decode rows (decode's
        slot, positions [B], visible [B, S] on stack) then one prompt's T tokens (prefill's slots
        [1, T], positions flat [T], seen [1, T, P] on chunk_stack) → (x [B + T, D], RoutingDecision
        or None); every product runs on the B + T rows at once, attention on each part's cache."""
        def mix(h):
            rows = self.attn.decode(h[:b], stack, at, slot, positions, cos[:b], sin_signed[:b], visible)
            chunk = self.attn.prefill(h[b:], chunk_stack, at, slots, flat, cos[b:], sin_signed[b:], seen)
            return torch.cat((rows, chunk))

        return self._rows(x, mix, None, routing)

    def _rows(self, x, mix, top_k, routing):
        """One layer over rows of one token each, x [N, D], the mixer being mix(normed x) → [N, D]."""
        residual = self.residual
        # A hook hands the residual back, and the step goes on with what it returned: compiled, the
        # hook is an opaque op (moekit.offload.graph_store), which the graph would drop, or move
        # past what it must run ahead of, if nothing used its output.
        if self.before_attn is not None:
            x = self.before_attn(x)
        h = mix(self.input_norm(x))
        x = x + (h * residual if residual != 1.0 else h)
        if self.before_ffn is not None:
            x = self.before_ffn(x)
        h = self.post_norm(x)
        decision = None
        if isinstance(self.ffn, MoE):
            h, decision = self.ffn.decode(h, top_k, routing)
        else:
            h = self.ffn.decode(h)
        return x + (h * residual if residual != 1.0 else h), decision


def _rows_end(cache: KVCache, lengths, end: Optional[int] = None) -> int:
    """The slots a decode step over rows at `lengths` [B] reads, max(lengths) + 1 (`end` where the
    caller knows it), checked against the cache's."""
    if end is None:
        end = int(lengths.max()) + 1
    if end > cache.max_len:
        raise ValueError(f"cache holds {cache.max_len} slots; a row asks for slot {end - 1}")
    return end


def _materialise(module: nn.Module, device, dtype: torch.dtype) -> None:
    """Give every meta parameter real, uninitialised storage in `dtype` (the checkpoint fills it next).

    Routers that score in fp32 keep fp32 weights, as the reference does. Only meta tensors are
    touched: the shared Rope (which MLAttention registers too) already holds its real tables.
    """
    for sub in module.modules():
        keep = dtype
        if isinstance(sub, Router) and sub.spec.fp32:
            keep = torch.float32
        for name, p in list(sub._parameters.items()):
            if p is not None and p.is_meta:
                # torch.empty, not empty_like: empty_like of a meta Parameter first imports ~35 MB of
                # torch internals (measured), which a memory-bounded run should not pay.
                real = torch.empty(p.shape, device=device, dtype=keep if p.is_floating_point() else p.dtype)
                sub._parameters[name] = nn.Parameter(real, requires_grad=False)


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32, device="cpu", offload_experts: bool = False):
        """offload_experts: build routed experts without weights (an expert store will serve them)."""
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        rope = Rope(spec.rope, _rope_width(spec), spec.max_position_embeddings).to(self.device)
        with torch.device("meta"):
            # A given _weight skips nn.Embedding's random init, whose meta-device path imports
            # torch's Python decompositions: ~70 MB of RSS and a slower start, for nothing.
            self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=torch.empty(spec.vocab_size, spec.hidden_size))
            self.layers = nn.ModuleList(Block(layer, rope, spec) for layer in spec.layers)
            self.norm = make_norm(spec.final_norm, spec.hidden_size)
            tied = spec.tie_word_embeddings
            self.lm_head = None if tied else Linear(spec.hidden_size, spec.vocab_size, bias=spec.lm_head_bias)
            # phimoe's lm_head_bias on a tied head: the bias is the head's own, the weight the table.
            self.head_bias = nn.Parameter(torch.empty(spec.vocab_size)) if tied and spec.lm_head_bias else None
        if offload_experts:
            for sub in self.modules():
                if isinstance(sub, RoutedExperts):
                    sub.offload()
        _materialise(self, self.device, dtype)
        self.rope = rope
        self.requires_grad_(False)
        self.moe_layers = [i for i, block in enumerate(self.layers) if isinstance(block.ffn, MoE)]
        # A step's decision width unless a row or a policy asks for more (StepRouting.width): the
        # model's K. A step takes any K up to E (MoE.specs_by_k), as the modules' forward does.
        self.widest_k = min((self.layers[i].ffn.router.spec.top_k for i in self.moe_layers), default=0)
        # The most experts a row may ask for: the fewest any MoE layer has (its specs_by_k, one per K).
        # Fixed once built; step_routing reads it every step (looked up through the modules: ~8 µs).
        self.most_k = min((len(self.layers[i].ffn.specs_by_k) for i in self.moe_layers), default=0)
        # Where the decode step finds a step's routing policy (moekit.model.seated_policy).
        self.seat = PolicySeat({i: self.layers[i].ffn.router.spec for i in self.moe_layers})
        for i in self.moe_layers:
            self.layers[i].ffn.seat = (self.seat.handle, i)
        # Whether decisions carry routing entropy (router health: moekit.engine.router_health.watch_routers).
        self.entropy_watched = False
        self.prepared = False
        # The decode step's kernel for a tied head (the embedding table, kept in the Hub layout):
        # PLAIN, or ROWS where prepare was told the command loaded the operators.
        self.tied_head_kernel = PLAIN
        self.compiled = None  # a moekit.model.compiled_step.CompiledStep once compile_decode() ran

    def new_cache(self, batch: int, max_len: int, stacked: bool = True) -> KVCache:
        """Preallocated slots for `batch` rows of up to `max_len` tokens; key_mask starts all True
        (the caller marks left-padding False). stacked: every layer's tensors as views of one
        (KVCache.stack, what the compiled step reads); False gives each its own (training, whose
        in-place writes carry gradients, which views of one tensor would route through all of it)."""
        self.rope.reserve(max_len)
        # Normal tensors even under inference_mode: the cache is written in place by later calls,
        # which may run outside it.
        with torch.inference_mode(False):
            shapes = [block.attn.new_cache(batch, max_len, self.dtype, "meta") for block in self.layers]
            layers, stack = stacked_layers(shapes, self.device, stacked)
            key_mask = torch.ones(batch, max_len, dtype=torch.bool, device=self.device)
        return KVCache(layers=layers, key_mask=key_mask, stack=stack)

    def forward(
        self,
        input_ids,
        cache: KVCache,
        positions,
        decisions: list | None = None,
        last_only: bool = False,
        top_k: list[int] | None = None,
        policy=None,
    ) -> torch.Tensor:
        """input_ids [B, T], positions [B, T] → logits [B, T, V] fp32; writes T slots of `cache`.

        When `decisions` is a list, (layer_index, RoutingDecision) is appended for every MoE layer.
        last_only: logits of the last position only, [B, 1, V] — what a prefill that goes on to
        generate needs; it skips T-1 rows of the LM head, the largest GEMM of a short prompt.
        top_k: None for the model's K, else one K per token of the B*T (expert-budget tiers).
        policy: None for the family's routing, else a routing.PolicyRun the caller owns (its state
        carries across calls, so one run serves a prefill and the decode steps after it).
        """
        start, t = cache.length, input_ids.shape[1]
        if start + t > cache.max_len:
            raise ValueError(f"cache holds {cache.max_len} slots; {start} used, {t} more asked")
        if t == 1 and self.steps_in_form(cache):
            slot = torch.full((input_ids.shape[0],), start, dtype=torch.int64, device=self.device)  # [B]
            logits = self._step(input_ids, cache, slot, positions[:, 0], cache.key_mask[:, : start + 1], decisions, top_k,
                                policy)
            cache.length = start + 1
            return logits
        if t > 1 and self.compiled is not None and self.compiled.prefills and self.steps_in_form(cache) \
                and self._prefill_form(top_k, policy, last_only):
            # None while no graph of this shape is ready (a server compiles them as it serves): the forward below
            result = self.compiled.prefill(input_ids, cache, positions, cache.key_mask[:, : start + t],
                                           StepRouting(entropy=self.entropy_watched), trace=False)
            if result is not None:
                if decisions is not None:
                    decisions.extend(result.decisions)
                cache.length = start + t
                return result.logits
        return self.forward_modules(input_ids, cache, positions, decisions, last_only, top_k, policy)

    def _prefill_form(self, top_k, policy, last_only: bool) -> bool:
        """Whether a compiled decoder's prefill runs as its own graph (moekit.model.prefill_step)."""
        from moekit.model.prefill_step import takes

        return takes(self, top_k, policy, last_only) is None

    def forward_modules(self, input_ids, cache: KVCache, positions, decisions: list | None = None,
                        last_only: bool = False, top_k: list[int] | None = None, policy=None) -> torch.Tensor:
        """forward through each module's `forward`, whatever T: a prefill, and a decode step that
        the step's form does not hold yet (steps_in_form); the reference the step is held to."""
        start, t = cache.length, input_ids.shape[1]
        if start + t > cache.max_len:
            raise ValueError(f"cache holds {cache.max_len} slots; {start} used, {t} more asked")
        key_mask = cache.key_mask[:, : start + t]
        if bool(key_mask.all()):
            key_mask = None  # no padding: the mixers skip masking (checked once here, not per layer)
        x = self.embed(input_ids)  # a fresh tensor: the blocks add into it in place
        if self.spec.multipliers.embedding != 1.0:
            x = x * self.spec.multipliers.embedding
        with self.rope.shared_for(positions, self.dtype):
            for i, block in enumerate(self.layers):
                x, decision = block(x, positions, cache.layers[i], start, key_mask, top_k,
                                    None if policy is None else policy.at(i), self.entropy_watched)
                if decisions is not None and decision is not None:
                    decisions.append((i, decision))
        cache.length = start + t
        if last_only:
            x = x[:, -1:]
        return self.head(self.norm(x))

    def forward_rows(
        self, input_ids, cache: KVCache, lengths, decisions: list | None = None, top_k: list[int] | None = None,
        policy=None, choices: list | None = None, end: Optional[int] = None,
    ) -> torch.Tensor:
        """One decode step over cache rows 0..B-1, each at its own length: continuous batching.

        input_ids [B, 1]; lengths [B] int64: slots row r already holds, so its new token goes to
        slot lengths[r] at RoPE position lengths[r] (rows are never padded: slot = position).
        Rows attend over their own slots only. → logits [B, 1, V] fp32. cache.length is not used.
        policy: None, or an object with .at(layer) → a LayerPolicy (engine.row_routing.RowRouting:
        each row routed by its own request's policy). choices: where the step's form runs, its
        StepChoices is appended here and `decisions` left as it is (the modules' forward fills
        `decisions` either way). end: max(lengths) + 1 where the caller knows it (saves a read of lengths).
        """
        b = input_ids.shape[0]
        end = _rows_end(cache, lengths, end)
        if self.steps_in_form(cache):
            # Rows are never padded (slot = position), so the cache's key_mask is all True here.
            return self._step(input_ids, cache, lengths, lengths, cache.key_mask[:b, :end], decisions, top_k, policy,
                              choices)
        if b == 1 or bool((lengths == lengths[0]).all()):
            key_mask = None  # every row sees slots 0..end-1: no mask, as a lone row decodes
        else:
            key_mask = torch.arange(end, device=lengths.device)[None, :] <= lengths[:, None]  # [B, S]
        positions = lengths[:, None]  # [B, 1]
        x = self.embed(input_ids)
        if self.spec.multipliers.embedding != 1.0:
            x = x * self.spec.multipliers.embedding
        with self.rope.shared_for(positions, self.dtype):
            for i, block in enumerate(self.layers):
                x, decision = block(x, positions, cache.layers[i], lengths, key_mask, top_k,
                                    None if policy is None else policy.at(i), self.entropy_watched)
                if decisions is not None and decision is not None:
                    decisions.append((i, decision))
        return self.head(self.norm(x))

    def forward_mixed(self, input_ids, cache: KVCache, lengths, chunk_ids, chunk_cache: KVCache,
                      decisions: list | None = None, chunk_decisions: list | None = None):
        """forward_rows (each row at the family's routing) and one chunk of a prompt (forward's
        prefill, last_only, into chunk_cache after its chunk_cache.length slots) as one compiled
        graph (moekit.model.mixed_step) → (logits [B, 1, V], the chunk's last token's [1, 1, V]),
        chunk_cache.length advanced; or None, nothing run, where that graph does not hold them:
        not compiled, not warmed up (CompiledStep.warm_up's MIXED_STEP), one row, a one-token chunk,
        or what the prefill form does not take (moekit.model.prefill_step.takes). The caller then
        runs the two forwards. decisions / chunk_decisions: as forward_rows' / forward's."""
        b, t = input_ids.shape[0], chunk_ids.shape[1]
        if not self.mixes(b, t) or not self.steps_in_form(cache) or not self.steps_in_form(chunk_cache):
            return None
        end = _rows_end(cache, lengths)
        start = chunk_cache.length
        positions = torch.arange(start, start + t, device=self.device)[None]  # [1, T]
        out = self.compiled.mixed(input_ids, cache, lengths, lengths, cache.key_mask[:b, :end], chunk_ids, chunk_cache,
                                  positions, StepRouting(entropy=self.entropy_watched))
        if out is None:
            return None
        logits, chosen, weights, entropy = out
        chunk_cache.length = start + t
        if decisions is not None:
            decisions.extend(step_decisions(self.moe_layers, chosen[:, :b], weights[:, :b],
                                            None if entropy is None else entropy[:, :b]))
        if chunk_decisions is not None:
            chunk_decisions.extend(step_decisions(self.moe_layers, chosen[:, b:], weights[:, b:],
                                                  None if entropy is None else entropy[:, b:]))
        return logits[:b, None, :], logits[b:, None, :]

    def mixes(self, rows: int, tokens: int) -> bool:
        """Whether a step of `rows` decode rows and a chunk of `tokens` can run as a mixed step
        (forward_mixed): compiled, its graph ready, more than one of each, the prefill form taking
        the prompt (moekit.model.prefill_step.takes: no hooks, no store)."""
        from moekit.model.prefill_step import takes

        return (self.compiled is not None and rows > 1 and tokens > 1 and self.compiled.mixes
                and takes(self, None, None, True) is None)

    def steps_in_form(self, cache: KVCache) -> bool:
        """Whether a T = 1 step over `cache` runs decode_step (each module's `decode`; compiled when
        compile_decode() ran, else eagerly, the same code), or the modules' forward. The one place
        that says what the step's form does not hold: an unstacked cache (training's) and a decoder
        not prepared (the step reads the fused projections prepare() makes). Everything else is the
        step's: per-row K up to E, routing policies (one opaque op a layer, seated_policy), router
        health's entropy (StepRouting.entropy), the expert store's prefetch hooks (Block.decode)."""
        return self.prepared and cache.stack is not None

    def step_routing(self, top_k, policy) -> StepRouting:
        """The StepRouting of a step with per-row Ks `top_k` (a list, or None) and `policy` (a
        PolicyRun or a RowRouting, or None): a policy's width is the widest it can choose."""
        entropy = self.entropy_watched
        if policy is not None:
            return StepRouting(max(policy.width(self.widest_k), 1), True, entropy)
        if top_k is None:  # the common step: one of two constants
            return WATCHED if entropy else FAMILY
        widest = max(top_k)
        if widest > self.most_k:
            raise ValueError(f"a row asks for {widest} experts per token; the model's MoE layers have {self.most_k}")
        return StepRouting(widest if widest > self.widest_k else 0, False, entropy)

    def _step(self, input_ids, cache, slot, positions, key_mask, decisions, top_k=None, policy=None,
              choices: list | None = None) -> torch.Tensor:
        """decode_step (compiled where compile_decode() ran) → logits [B, 1, V] fp32. A policy
        decides the routing over top_k (as the modules' forward lets it). choices: see forward_rows."""
        routing = self.step_routing(top_k, policy)
        ks = None
        if top_k is not None and policy is None:
            ks = torch.tensor(top_k, dtype=torch.int64, device=self.device)  # [B]
        # Nothing to seat without a policy: only a seated step (StepRouting.seated) reads the seat.
        with NOTHING_SEATED if policy is None else self.seat.holding(policy):
            logits, chosen, weights, entropy = self._step_outputs(input_ids, cache, slot, positions, key_mask, ks, routing)
        if choices is not None:
            choices.append(StepChoices(self.moe_layers, chosen, weights, entropy))
        elif decisions is not None:
            decisions.extend(step_decisions(self.moe_layers, chosen, weights, entropy))
        return logits[:, None, :]

    def _step_outputs(self, input_ids, cache, slot, positions, key_mask, ks, routing: StepRouting) -> tuple:
        """decode_step's outputs (logits [B, V], chosen, weights, entropy or None): the compiled
        graph's where compile_decode() ran, else the eager step's."""
        if self.compiled is not None:
            return self.compiled.outputs(input_ids, cache, slot, positions, key_mask, ks, routing)
        return decode_step(self, input_ids[:, 0], slot, positions, key_mask, cache.stack, self.rope.cos_table,
                           self.rope.sin_signed_table, ks, routing)

    def compile_decode(self, cpp_wrapper: bool = True) -> None:
        """Run every later T = 1 step (generate's decode, continuous batching, routing policies) as one
        compiled graph (moekit.model.compiled_step), where it applies; a prompt's prefill too, as a
        graph of its own, once CompiledStep.warm_up was given prefill shapes (a server's), where it
        applies (moekit.model.prefill_step.takes); else the modules' forward.
        Needs a decoder prepared with kernels=False (the Hub layout the compiled step reads).
        cpp_wrapper: see CompiledStep (False compiles faster and runs the same kernels slower)."""
        from moekit.model.compiled_step import CompiledStep

        self.compiled = CompiledStep(self, cpp_wrapper)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        # A tied head shares the embedding table, which the lookup needs in the Hub layout: plain F.linear.
        logits = nn.functional.linear(h, self.embed.weight, self.head_bias) if self.lm_head is None else self.lm_head(h)
        if self.spec.multipliers.logits_scaling != 1.0:
            logits = logits / self.spec.multipliers.logits_scaling
        return logits.float()

    def load_checkpoint(self, ckpt, kernels: bool = True, operators: bool = False, int8: bool = False) -> None:
        """Fill every parameter from `ckpt` (Hub names, all checked), then prepare the fast layouts
        (kernels=False keeps the Hub layout, which the compiled decode step reads; operators: see prepare).
        int8: the projections `--weights int8` quantizes are quantized as they are read (moekit.model.loading)."""
        from moekit.model.loading import load_into

        if self.prepared:
            raise RuntimeError("load_checkpoint on a prepared decoder: build a new Decoder to load again")
        load_into(self, ckpt, int8=int8)
        self.prepare(kernels, operators)

    def prepare(self, kernels: bool = True, operators: bool = False) -> None:
        """Lay each projection's weight out for its kernel, once; the Hub layout is dropped, not kept.
        kernels=False: every projection stays in the Hub layout and runs the plain reference kernel.
        operators: the command loaded moekit's operators (`--kernels auto`), so the eager decode
        step's fp32 / bf16 products run them (moekit.model.linear.ROWS); told, not looked up, so
        that one command sums the same way in every process, whatever else it registered."""
        if self.prepared:
            return

        for sub in list(self.modules()):
            if isinstance(sub, (Attention, MLAttention)):
                sub.prepare()  # fusions on the Hub layout come first
        if kernels:
            prepare_linears(self, operators)
            if self.lm_head is None and kernel_for(self.embed.weight, operators) is ROWS:
                self.tied_head_kernel = ROWS
        for sub in self.modules():
            if isinstance(sub, RoutedExperts):
                sub.prepare(kernels, operators)
        self.prepared = True


def decode_step(decoder, ids, slot, positions, key_mask, stack, cos_table, sin_table, top_k=None, routing=FAMILY):
    """The decoder's T = 1 step as plain tensor algebra (each module's `decode`), what
    moekit.model.compiled_step captures as one graph. ids, slot, positions [B] int64; key_mask
    [B, S] (False at padding; S = the last slot + 1); stack: the cache's tensors as one
    (KVCache.stack: k, v per attention layer, one per MLA layer); cos_table / sin_table: the rope's;
    top_k: None for the model's K, else each row's K [B] int64 (expert-budget tiers), up to
    routing.width where that is set; routing: the step's StepRouting (a seated policy decides over
    top_k) → (logits [B, V] fp32, topk_ids [L_moe, B, K], topk_weights [L_moe, B, K], and the
    routing entropy [L_moe, B] where routing.entropy, else None)."""
    spec = decoder.spec
    end = key_mask.shape[1]
    visible = key_mask & (torch.arange(end, device=ids.device)[None, :] <= slot[:, None])  # [B, S]
    x = decoder.embed.weight[ids]  # [B, D]
    if spec.multipliers.embedding != 1.0:
        x = x * spec.multipliers.embedding
    turn = torch.float32 if decoder.rope.fp32 else x.dtype  # the dtype RoPE rotates in
    cos = cos_table[positions][:, None, :].to(turn)  # [B, 1, rot]
    sin_signed = sin_table[positions][:, None, :].to(turn)
    chosen, weights, entropy = [], [], []
    at = 0  # the layer's first tensor in the stack
    for block in decoder.layers:
        x, decision = block.decode(x, stack, at, slot, positions, cos, sin_signed, visible, top_k, routing)
        at += block.attn.cache_tensors
        if decision is not None:
            chosen.append(decision.topk_ids)
            weights.append(decision.topk_weights)
            entropy.append(decision.entropy)
    return step_outputs(decoder, decoder.norm(x), x.shape[0], chosen, weights, entropy, routing)


def step_outputs(decoder, x, rows: int, chosen: list, weights: list, entropy: list, routing: StepRouting):
    """A step's (or prefill's) last part, shared by decode_step and prefill_step: the head on the
    normed x [B, D] → (logits [B, V] fp32, chosen [L_moe, rows, K], weights [L_moe, rows, K], entropy
    [L_moe, rows] where routing.entropy, else None) from the MoE layers' per-layer lists (empty for a
    dense model: K = 0)."""
    if not chosen:  # a dense model: no routing to report
        chosen = weights = [torch.zeros((rows, 0), dtype=torch.int64, device=x.device)]
        entropy = [torch.zeros((rows,), device=x.device)]
    if decoder.lm_head is None:  # tied: the embedding table, in the Hub layout
        logits = linear_rows(x, decoder.embed.weight, decoder.head_bias, decoder.tied_head_kernel)
    else:
        logits = project(decoder.lm_head, x)
    if decoder.spec.multipliers.logits_scaling != 1.0:
        logits = logits / decoder.spec.multipliers.logits_scaling
    return logits.float(), torch.stack(chosen), torch.stack(weights), torch.stack(entropy) if routing.entropy else None


def step_decisions(moe_layers: list, chosen: torch.Tensor, weights: torch.Tensor, entropy=None) -> list:
    """decode_step's chosen / weights [L_moe, B, K] (and entropy [L_moe, B] or None) → (layer index,
    RoutingDecision) per MoE layer."""
    each = entropy.unbind(0) if entropy is not None else [None] * len(moe_layers)
    return [(layer, RoutingDecision(ids, w, h))
            for layer, ids, w, h in zip(moe_layers, chosen.unbind(0), weights.unbind(0), each)]
