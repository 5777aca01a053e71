"""Parameter counts written out as formulas (products of config numbers), one term per weight
matrix, so `--explain` can show every step and a reader can redo it by hand.

This is the slow, obvious second count: tests check that its category totals equal
`moekit.calc.params`' breakdown for every preset, so the formulas printed are the ones counted.
Categories follow the breakdown: q/k norms, MLA's latent norms and attention sinks sit in
`attention` (they live inside the attention module); qwen2_moe's shared-expert gate sits in
`shared_experts`; per-layer and final norms in `norms`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

from moekit.spec.model_spec import AttentionSpec, LayerSpec, MambaSpec, MLPSpec, ModelSpec

# Breakdown fields the formulas fill; mtp and vision come from the adapter, not from formulas.
CATEGORIES = (
    "embedding",
    "attention",
    "mamba",
    "router",
    "routed_experts_total",
    "routed_experts_active",
    "shared_experts",
    "dense_mlp",
    "norms",
    "head",
)


@dataclass(frozen=True)
class Term:
    label: str
    factors: tuple[int, ...]

    @property
    def value(self) -> int:
        return math.prod(self.factors)

    @property
    def formula(self) -> str:
        return " × ".join(f"{f:,}" for f in self.factors)


def total(terms: list[Term]) -> int:
    return sum(t.value for t in terms)


def attention_terms(a: AttentionSpec) -> list[Term]:
    d = a.hidden_size
    if a.kind == "mla":
        return _mla_terms(a)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    terms = [
        Term("q_proj  D × heads × head_dim", (d, a.num_heads, a.head_dim)),
        Term("k_proj  D × kv_heads × head_dim", (d, a.num_kv_heads, a.head_dim)),
        Term("v_proj  D × kv_heads × head_dim", (d, a.num_kv_heads, a.head_dim)),
        Term("o_proj  heads × head_dim × D", (a.num_heads, a.head_dim, d)),
    ]
    if a.qkv_bias:
        terms.append(Term("q, k, v biases  heads × head_dim + 2 × kv_heads × head_dim", (q + 2 * kv,)))
    if a.o_bias:
        terms.append(Term("o bias  D", (d,)))
    if a.qk_norm == "head":
        terms.append(Term("q and k norms  2 × head_dim", (2, a.head_dim)))
    elif a.qk_norm == "full":
        terms.append(Term("q and k norms  heads × head_dim + kv_heads × head_dim", (q + kv,)))
    if a.sinks:
        terms.append(Term("sinks  one per head", (a.num_heads,)))
    return terms


def _mla_terms(a: AttentionSpec) -> list[Term]:
    d, h = a.hidden_size, a.num_heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    terms = []
    if a.q_lora_rank:
        terms += [
            Term("q_a_proj  D × q_lora_rank", (d, a.q_lora_rank)),
            Term("q_a_layernorm  q_lora_rank", (a.q_lora_rank,)),
            Term("q_b_proj  q_lora_rank × heads × (nope + rope)", (a.q_lora_rank, h, qk)),
        ]
        if a.qkv_bias:
            terms.append(Term("q_a_proj bias  q_lora_rank", (a.q_lora_rank,)))
    else:
        terms.append(Term("q_proj  D × heads × (nope + rope)", (d, h, qk)))
    terms += [
        Term("kv_a_proj  D × (kv_lora_rank + rope)", (d, a.kv_lora_rank + a.qk_rope_head_dim)),
        Term("kv_a_layernorm  kv_lora_rank", (a.kv_lora_rank,)),
        Term("kv_b_proj  kv_lora_rank × heads × (nope + v)", (a.kv_lora_rank, h, a.qk_nope_head_dim + a.v_head_dim)),
        Term("o_proj  heads × v_head_dim × D", (h, a.v_head_dim, d)),
    ]
    if a.qkv_bias:
        terms.append(Term("kv_a_proj bias  kv_lora_rank + rope", (a.kv_lora_rank + a.qk_rope_head_dim,)))
    if a.o_bias:
        terms.append(Term("o bias  D", (d,)))
    return terms


def mamba_terms(m: MambaSpec) -> list[Term]:
    """transformers' JambaMambaMixer, matrix by matrix."""
    d, i = m.hidden_size, m.d_inner
    terms = [
        Term("in_proj  D × 2 × d_inner", (d, 2, i)),
        Term("conv1d  d_inner × d_conv", (i, m.d_conv)),
        Term("x_proj  d_inner × (dt_rank + 2 × d_state)", (i, m.dt_rank + 2 * m.d_state)),
        Term("dt_proj  dt_rank × d_inner + d_inner", (m.dt_rank * i + i,)),
        Term("A_log  d_inner × d_state", (i, m.d_state)),
        Term("D  d_inner", (i,)),
        Term("out_proj  d_inner × D", (i, d)),
    ]
    if m.conv_bias:
        terms.append(Term("conv1d bias  d_inner", (i,)))
    if m.proj_bias:
        terms.append(Term("in/out_proj biases  2 × d_inner + D", (2 * i + d,)))
    if m.inner_norms:
        terms.append(Term("dt, B, C norms  dt_rank + 2 × d_state", (m.dt_rank + 2 * m.d_state,)))
    return terms


def mlp_terms(mlp: MLPSpec, what: str) -> list[Term]:
    mats, names = (3, "gate, up, down") if mlp.gated else (2, "up, down")
    terms = [Term(f"{what} ({names})  {mats} × D × F", (mats, mlp.hidden_size, mlp.width))]
    if mlp.bias:
        terms.append(
            Term(f"{what} biases  {'2 × F + D' if mlp.gated else 'F + D'}", ((2 if mlp.gated else 1) * mlp.width + mlp.hidden_size,))
        )
    return terms


def _normalised(layer: LayerSpec) -> LayerSpec:
    """A layer with what does not change its parameters (window sizes) stripped, for grouping."""
    mixer = layer.mixer
    if isinstance(mixer, AttentionSpec):
        mixer = replace(mixer, sliding_window=None, chunk_size=None)
    return replace(layer, mixer=mixer)


@dataclass(frozen=True)
class LayerFormula:
    """The terms of one layer, shared by every layer in `indices`."""

    indices: tuple[int, ...]
    mixer_kind: str  # "attention" or "mamba"
    mixer: list[Term]
    norms: list[Term]
    dense: list[Term] = field(default_factory=list)
    router: list[Term] = field(default_factory=list)
    expert: list[Term] = field(default_factory=list)  # ONE routed expert
    shared: list[Term] = field(default_factory=list)
    num_experts: int = 0  # E
    top_k: int = 0  # K

    @property
    def count(self) -> int:
        return len(self.indices)

    def per_layer(self) -> dict[str, int]:
        one = total(self.expert)
        return {
            self.mixer_kind: total(self.mixer),
            "router": total(self.router),
            "routed_experts_total": self.num_experts * one,
            "routed_experts_active": self.top_k * one,
            "shared_experts": total(self.shared),
            "dense_mlp": total(self.dense),
            "norms": total(self.norms),
        }


def layer_formula(indices: tuple[int, ...], layer: LayerSpec) -> LayerFormula:
    d = layer.mixer.hidden_size
    mixer = layer.mixer
    kind, mixer_terms = (
        ("attention", attention_terms(mixer)) if isinstance(mixer, AttentionSpec) else ("mamba", mamba_terms(mixer))
    )
    n_norms = 2 + layer.extra_norms
    norms = [Term(f"norms  {n_norms} × {'2 × D' if layer.norm.bias else 'D'}", (n_norms, layer.norm.params(d)))]
    ffn = layer.ffn
    if isinstance(ffn, MLPSpec):
        return LayerFormula(indices, kind, mixer_terms, norms, dense=mlp_terms(ffn, "dense MLP"))
    router = [Term("router  D × E", (d, ffn.num_experts))]
    if ffn.router.bias:
        router.append(Term("router bias  E", (ffn.num_experts,)))
    shared = []
    if ffn.shared is not None:
        shared = mlp_terms(ffn.shared, f"shared experts ×{ffn.num_shared} fused" if ffn.num_shared > 1 else "shared expert")
        if ffn.shared_gate:
            shared.append(Term("shared_expert_gate  D × 1", (d,)))
    return LayerFormula(
        indices,
        kind,
        mixer_terms,
        norms,
        router=router,
        expert=mlp_terms(ffn.expert, "one routed expert"),
        shared=shared,
        num_experts=ffn.num_experts,
        top_k=ffn.top_k,
    )


def layer_groups(spec: ModelSpec) -> list[LayerFormula]:
    """Layers with equal parameters grouped, in order of first appearance."""
    groups: dict[LayerSpec, list[int]] = defaultdict(list)
    for i, layer in enumerate(spec.layers):
        groups[_normalised(layer)].append(i)
    return [layer_formula(tuple(idx), layer) for layer, idx in groups.items()]


@dataclass(frozen=True)
class ModelFormula:
    groups: list[LayerFormula]
    embedding: Term
    head: Term | None  # None when tied to the embedding
    final_norm: Term
    categories: dict[str, int]

    @property
    def total(self) -> int:
        return sum(v for k, v in self.categories.items() if k != "routed_experts_active")


def model_formula(spec: ModelSpec) -> ModelFormula:
    groups = layer_groups(spec)
    d, v = spec.hidden_size, spec.vocab_size
    embedding = Term("embedding  V × D", (v, d))
    head = None if spec.tie_word_embeddings else Term("lm_head  D × V", (d, v))
    final_norm = Term("final norm  D", (spec.final_norm.params(d),))
    cats = dict.fromkeys(CATEGORIES, 0)
    for g in groups:
        for key, value in g.per_layer().items():
            cats[key] += value * g.count
    cats["embedding"] = embedding.value
    cats["head"] = head.value if head else 0
    cats["norms"] += final_norm.value
    return ModelFormula(groups, embedding, head, final_norm, cats)
