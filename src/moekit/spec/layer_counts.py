"""One decoder layer's parameters from its LayerSpec: the per-layer rule the calculator sums and a
spec adapter uses where a config describes extra layers (DeepSeek's MTP modules).

It sits in spec, below calc, so that an adapter counts with the one shared rule without spec
importing calc. "Exact" as in moekit.calc.params: equal to transformers' parameter count. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.spec.model_spec import AttentionSpec, LayerSpec, MambaSpec, MLPSpec, MoESpec, RouterSpec


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
