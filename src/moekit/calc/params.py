"""Exact parameter counts from a ModelSpec: total, active per token, and where they sit.

"Exact" means equal to `sum(p.numel() for p in model.parameters())` of the transformers CausalLM
built from the same config (tests check every family that way). Buffers are not parameters:
DeepSeek-V3's `e_score_correction_bias` is not counted, as transformers does not count it.

Three "active" conventions, because vendors publish all three (see DESIGN.md):

- `active_params`: everything one token touches; the input embedding table and the output head
  counted in full (Mistral, Qwen, Meta, Databricks).
- `active_params_excl_input_embedding`: without the input embedding (DeepSeek, OpenAI). With tied
  embeddings the one table is also the output head, which a token does use: it stays in.
- `active_params_non_embedding`: neither the input embedding nor the output head; with tied
  embeddings the one table is removed once.

A tied table is counted once everywhere (`breakdown.head` is 0). MTP modules and a vision tower
are reported in the breakdown and left out of every total.

No torch here: the calculator runs where only moekit is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.spec.model_spec import AttentionSpec, LayerSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, RouterSpec


@dataclass(frozen=True)
class Breakdown:
    embedding: int
    attention: int
    router: int
    routed_experts_total: int
    routed_experts_active: int
    shared_experts: int
    dense_mlp: int
    norms: int
    head: int  # 0 when tied to the embedding (bar phimoe's lm_head bias)
    mamba: int  # mamba mixers (jamba), 0 elsewhere
    mtp: int  # reported apart, NOT in total_params
    vision: int  # reported apart, NOT in total_params


@dataclass(frozen=True)
class ParamCounts:
    total_params: int  # decoder only, as the text CausalLM counts it
    active_params: int  # everything a token touches, input embedding + head in full
    active_params_excl_input_embedding: int  # DeepSeek / OpenAI convention
    active_params_non_embedding: int  # neither embedding nor head
    active_fraction: float  # active_params / total_params
    breakdown: Breakdown


@dataclass(frozen=True)
class LayerCounts:
    """One decoder layer's parameters, split the way the activation meter needs them."""

    mixer: int  # attention or mamba, with its own q/k norms and sinks
    norms: int  # the layer's pre-norms (and any extra norms)
    dense_mlp: int  # 0 in an MoE layer
    router: int
    shared: int  # shared experts and their gate
    expert_each: int  # one routed expert
    num_experts: int  # E (0 in a dense layer)
    top_k: int  # K (0 in a dense layer)

    @property
    def always_on(self) -> int:
        """What every token touches in this layer whichever experts it picks."""
        return self.mixer + self.norms + self.dense_mlp + self.router + self.shared

    @property
    def total(self) -> int:
        return self.always_on + self.expert_each * self.num_experts

    @property
    def active(self) -> int:
        return self.always_on + self.expert_each * self.top_k


def _linear(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def _mla_params(a: AttentionSpec) -> int:
    """DeepSeek latent attention; `qkv_bias` is attention_bias on q_a_proj and kv_a_proj only."""
    d, h = a.hidden_size, a.num_heads
    if a.q_lora_rank is None:
        q = _linear(d, h * a.head_dim, False)
    else:  # q_a_proj, q_a_layernorm, q_b_proj
        q = _linear(d, a.q_lora_rank, a.qkv_bias) + a.q_lora_rank + _linear(a.q_lora_rank, h * a.head_dim, False)
    kv_a = _linear(d, a.kv_lora_rank + a.qk_rope_head_dim, a.qkv_bias) + a.kv_lora_rank  # + kv_a_layernorm
    kv_b = _linear(a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim), False)
    o = _linear(h * a.v_head_dim, d, a.o_bias)
    return q + kv_a + kv_b + o


def attention_params(a: AttentionSpec) -> int:
    if a.kind == "mla":
        return _mla_params(a)
    d, q_width, kv_width = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    p = _linear(d, q_width, a.qkv_bias) + 2 * _linear(d, kv_width, a.qkv_bias) + _linear(q_width, d, a.o_bias)
    if a.qk_norm == "head":  # one RMSNorm weight of head_dim each for q and k, shared by heads
        p += 2 * a.head_dim
    elif a.qk_norm == "full":  # over the whole q and k projections
        p += q_width + kv_width
    if a.sinks:
        p += a.num_heads
    return p


def mamba_params(m: MambaSpec) -> int:
    """jamba's mixer: in_proj (D → 2·inner), depthwise conv, x_proj, dt_proj, A_log, D, out_proj."""
    inner, state, rank = m.d_inner, m.d_state, m.dt_rank
    p = _linear(m.hidden_size, 2 * inner, m.proj_bias)
    p += inner * m.d_conv + (inner if m.conv_bias else 0)  # conv1d, one filter per channel
    p += _linear(inner, rank + 2 * state, False)  # x_proj → (dt, B, C)
    p += _linear(rank, inner, True)  # dt_proj always has a bias
    p += inner * state + inner  # A_log, D
    p += _linear(inner, m.hidden_size, m.proj_bias)
    if m.inner_norms:  # RMSNorms on dt, B and C
        p += rank + 2 * state
    return p


def expert_params(mlp: MLPSpec) -> int:
    return mlp.params()


def router_params(router: RouterSpec, hidden: int) -> int:
    """The gate Linear(D, E); a selection bias is a buffer, not a parameter."""
    return _linear(hidden, router.num_experts, router.bias)


def shared_params(moe: MoESpec) -> int:
    p = moe.shared.params() if moe.shared is not None else 0
    if moe.shared_gate:  # qwen2_moe's Linear(D, 1) behind a sigmoid
        p += moe.expert.hidden_size
    return p


def _mixer_params(mixer: AttentionSpec | MambaSpec) -> int:
    return mamba_params(mixer) if isinstance(mixer, MambaSpec) else attention_params(mixer)


def layer_params(layer: LayerSpec) -> LayerCounts:
    width = layer.mixer.hidden_size
    norms = layer.norm.params(width) * (2 + layer.extra_norms)
    mixer = _mixer_params(layer.mixer)
    if isinstance(layer.ffn, MoESpec):
        moe = layer.ffn
        return LayerCounts(
            mixer=mixer,
            norms=norms,
            dense_mlp=0,
            router=router_params(moe.router, width),
            shared=shared_params(moe),
            expert_each=expert_params(moe.expert),
            num_experts=moe.num_experts,
            top_k=moe.top_k,
        )
    return LayerCounts(
        mixer=mixer,
        norms=norms,
        dense_mlp=layer.ffn.params(),
        router=0,
        shared=0,
        expert_each=0,
        num_experts=0,
        top_k=0,
    )


def count_params(spec: ModelSpec) -> ParamCounts:
    counts = [(layer, layer_params(layer)) for layer in spec.layers]
    embedding = spec.vocab_size * spec.hidden_size
    head = (0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size) + (
        spec.vocab_size if spec.lm_head_bias else 0
    )
    breakdown = Breakdown(
        embedding=embedding,
        attention=sum(c.mixer for layer, c in counts if isinstance(layer.mixer, AttentionSpec)),
        router=sum(c.router for _, c in counts),
        routed_experts_total=sum(c.expert_each * c.num_experts for _, c in counts),
        routed_experts_active=sum(c.expert_each * c.top_k for _, c in counts),
        shared_experts=sum(c.shared for _, c in counts),
        dense_mlp=sum(c.dense_mlp for _, c in counts),
        norms=sum(c.norms for _, c in counts) + spec.final_norm.params(spec.hidden_size),
        head=head,
        mamba=sum(c.mixer for layer, c in counts if isinstance(layer.mixer, MambaSpec)),
        mtp=spec.mtp_params,
        vision=spec.vision_params,
    )
    b = breakdown
    always_on = b.attention + b.mamba + b.router + b.shared_experts + b.dense_mlp + b.norms
    total = b.embedding + head + always_on + b.routed_experts_total
    active = b.embedding + head + always_on + b.routed_experts_active
    # A tied table is also the output head: excluding the input embedding keeps it (see module doc).
    excl_input = active - (0 if spec.tie_word_embeddings else b.embedding)
    non_embedding = active - b.embedding - head
    return ParamCounts(
        total_params=total,
        active_params=active,
        active_params_excl_input_embedding=excl_input,
        active_params_non_embedding=non_embedding,
        active_fraction=active / total,
        breakdown=breakdown,
    )
