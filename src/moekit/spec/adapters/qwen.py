"""The Qwen families: qwen2_moe (shared expert behind a sigmoid gate), qwen3_moe (q/k norm), and
the dense qwen2 / qwen3.

Which layers are MoE: layer i is sparse unless it is in `mlp_only_layers` or
(i + 1) % decoder_sparse_step != 0; dense layers take `intermediate_size`, experts
`moe_intermediate_size`. With num_experts = 0 every layer is dense.
"""

from __future__ import annotations

from typing import Optional

from moekit.errors import SpecError
from moekit.spec.adapters import common
from moekit.spec.config_fields import ConfigFields
from moekit.spec.model_spec import AttentionSpec, FeedForward, LayerSpec, ModelSpec, MoESpec
from moekit.spec.rope import rope_spec

_COMMON = {
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "bos_token_id": None,
    "eos_token_id": None,
}
QWEN2_MOE_DEFAULTS = {
    **_COMMON,
    "intermediate_size": 5632,
    "num_key_value_heads": 16,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "norm_topk_prob": False,
    "mlp_only_layers": None,
    "qkv_bias": True,
}
QWEN3_MOE_DEFAULTS = {
    **_COMMON,
    "intermediate_size": 6144,
    "num_key_value_heads": 4,
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "mlp_only_layers": None,
}
QWEN2_DEFAULTS = {**_COMMON, "intermediate_size": 22016, "num_key_value_heads": 32}
QWEN3_DEFAULTS = {
    **_COMMON,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "attention_bias": False,
}
DEFAULT_THETA = 10000.0
_ALIASES = {"num_local_experts": "num_experts"}


def _sparse_layers(f: ConfigFields, num_layers: int) -> tuple[bool, ...]:
    if f.int("num_experts") == 0:
        return (False,) * num_layers
    step = f.size("decoder_sparse_step")
    dense = set(f.int_list("mlp_only_layers"))
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _dense_windows(f: ConfigFields, num_layers: int) -> tuple[Optional[int], ...]:
    """qwen2 / qwen3: sliding from layer max_window_layers on, when use_sliding_window."""
    window = f.opt_size("sliding_window") if f.bool("use_sliding_window") else None
    first = f.int("max_window_layers")
    default = [
        "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
    ]
    return common.layer_windows(f, num_layers, default, window)


def _moe(f: ConfigFields, hidden: int, act: str, shared: bool) -> MoESpec:
    num_experts, top_k = common.expert_counts(f, "num_experts")
    router = common.router(num_experts=num_experts, top_k=top_k, normalize=f.bool("norm_topk_prob"))
    expert = common.gated_mlp(hidden, f.size("moe_intermediate_size"), act)  # type: ignore[arg-type]
    if not shared:
        return MoESpec(router=router, expert=expert)
    width = f.int("shared_expert_intermediate_size")
    if width < 0:
        raise SpecError(f"{f.family} config: 'shared_expert_intermediate_size' must not be negative, got {width}")
    # The shared_expert_gate Linear(D, 1) exists even when the shared expert has no width.
    shared_mlp = common.gated_mlp(hidden, width, act) if width else None  # type: ignore[arg-type]
    return MoESpec(router=router, expert=expert, shared=shared_mlp, num_shared=1 if width else 0, shared_gate=True)


def _layers(
    f: ConfigFields, attentions: list[AttentionSpec], sparse: tuple[bool, ...], moe: Optional[MoESpec]
) -> list[LayerSpec]:
    hidden = f.size("hidden_size")
    norm = common.rms_norm(f)
    dense = common.gated_mlp(hidden, f.size("intermediate_size"), common.activation(f)) if not all(sparse) else None
    out = []
    for attention, is_moe in zip(attentions, sparse):
        ffn: FeedForward = moe if is_moe else dense  # type: ignore[assignment]
        out.append(LayerSpec(mixer=attention, ffn=ffn, norm=norm))
    return out


def build_qwen2_moe(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, QWEN2_MOE_DEFAULTS, "qwen2_moe", _ALIASES)
    hidden, heads, num_layers = f.size("hidden_size"), f.size("num_attention_heads"), f.size("num_hidden_layers")
    use_sliding = f.bool("use_sliding_window")
    window = f.opt_size("sliding_window") if use_sliding else None
    first = f.int("max_window_layers")
    # Qwen2MoeConfig's own pattern: even layers below max_window_layers slide.
    default = [
        "sliding_attention" if (i + 1) % 2 and i < first and use_sliding else "full_attention"
        for i in range(num_layers)
    ]
    windows = common.layer_windows(f, num_layers, default, window)
    head_dim = common.head_dim(f, hidden, heads)
    qkv_bias = f.bool("qkv_bias")
    attentions = [common.mha(f, head_dim=head_dim, qkv_bias=qkv_bias, sliding_window=w) for w in windows]
    sparse = _sparse_layers(f, num_layers)
    moe = _moe(f, hidden, common.activation(f), shared=True) if any(sparse) else None
    layers = _layers(f, attentions, sparse, moe)
    return common.model_spec(f, name, "qwen2_moe", layers, rope_spec(f, DEFAULT_THETA), common.rms_norm(f))


def build_qwen3_moe(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, QWEN3_MOE_DEFAULTS, "qwen3_moe", _ALIASES)
    hidden, heads, num_layers = f.size("hidden_size"), f.size("num_attention_heads"), f.size("num_hidden_layers")
    # Qwen3MoeConfig keeps sliding_window only under use_sliding_window, then every layer slides.
    window = f.opt_size("sliding_window") if f.bool("use_sliding_window") else None
    bias = f.bool("attention_bias")
    attention = common.mha(
        f, head_dim=common.head_dim(f, hidden, heads), qkv_bias=bias, o_bias=bias, qk_norm="head", sliding_window=window
    )
    sparse = _sparse_layers(f, num_layers)
    moe = _moe(f, hidden, common.activation(f), shared=False) if any(sparse) else None
    layers = _layers(f, [attention] * num_layers, sparse, moe)
    return common.model_spec(f, name, "qwen3_moe", layers, rope_spec(f, DEFAULT_THETA), common.rms_norm(f))


def build_qwen2(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, QWEN2_DEFAULTS, "qwen2")
    hidden, heads, num_layers = f.size("hidden_size"), f.size("num_attention_heads"), f.size("num_hidden_layers")
    head_dim = common.head_dim(f, hidden, heads)
    # Qwen2Attention hard-codes bias on q/k/v and none on o.
    attentions = [
        common.mha(f, head_dim=head_dim, qkv_bias=True, sliding_window=w) for w in _dense_windows(f, num_layers)
    ]
    layers = _layers(f, attentions, (False,) * num_layers, None)
    return common.model_spec(f, name, "qwen2", layers, rope_spec(f, DEFAULT_THETA), common.rms_norm(f))


def build_qwen3(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, QWEN3_DEFAULTS, "qwen3")
    hidden, heads, num_layers = f.size("hidden_size"), f.size("num_attention_heads"), f.size("num_hidden_layers")
    head_dim = common.head_dim(f, hidden, heads)
    bias = f.bool("attention_bias")
    attentions = [
        common.mha(f, head_dim=head_dim, qkv_bias=bias, o_bias=bias, qk_norm="head", sliding_window=w)
        for w in _dense_windows(f, num_layers)
    ]
    layers = _layers(f, attentions, (False,) * num_layers, None)
    return common.model_spec(f, name, "qwen3", layers, rope_spec(f, DEFAULT_THETA), common.rms_norm(f))


