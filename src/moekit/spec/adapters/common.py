"""Pieces every family adapter shares: reading attention, norms, token ids and expert counts.

Each family module states its transformers defaults as data and calls these; anything a family
does differently stays in that family's module.
"""

from __future__ import annotations

from typing import Optional, Sequence

from moekit.errors import SpecError
from moekit.spec.config_fields import ConfigFields
from moekit.spec.model_spec import (
    Activation,
    AttentionSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    NormSpec,
    RopeSpec,
    RouterSpec,
)

# transformers' ACT2FN names → the activations the engine implements.
_ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def fields(config: dict, defaults: dict, family: str, aliases: Optional[dict] = None) -> ConfigFields:
    return ConfigFields(config, defaults, family, aliases or {})


def activation(f: ConfigFields, key: str = "hidden_act") -> Activation:
    name = f.str(key)
    if name not in _ACTIVATIONS:
        raise SpecError(f"{f.family} config: '{key}' = {name!r} is not supported (known: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def rms_norm(f: ConfigFields, key: str = "rms_norm_eps") -> NormSpec:
    return NormSpec(kind="rms", eps=f.float(key))


def token_ids(f: ConfigFields) -> tuple[Optional[int], tuple[int, ...]]:
    bos = f.opt_int("bos_token_id")
    eos = f.get("eos_token_id")
    if eos is None:
        return bos, ()
    if isinstance(eos, (list, tuple)):
        ids = eos
    else:
        ids = [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise SpecError(f"{f.family} config: 'eos_token_id' must be an integer or a list of integers, got {eos!r}")
    return bos, tuple(ids)


def kv_heads(f: ConfigFields, heads: int) -> int:
    """num_key_value_heads, None meaning one per query head (every family's __post_init__)."""
    kv = f.opt_size("num_key_value_heads")
    kv = heads if kv is None else kv
    if heads % kv:
        raise SpecError(
            f"{f.family} config: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})"
        )
    return kv


def head_dim(f: ConfigFields, hidden: int, heads: int) -> int:
    """head_dim when the file states a non-null one, else hidden // heads.

    Families that have no head_dim field still honour one present in config.json (their attention
    reads `getattr(config, "head_dim", hidden // heads)`); qwen3 has its own default (128) and
    passes it through `defaults`.
    """
    value = f.opt_size("head_dim") if (f.has("head_dim") or "head_dim" in f.defaults) else None
    return value if value is not None else hidden // heads


def mha(
    f: ConfigFields,
    *,
    head_dim: int,
    qkv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: Optional[str] = None,
    sliding_window: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    sinks: bool = False,
    chunk_size: Optional[int] = None,
    use_rope: bool = True,
) -> AttentionSpec:
    hidden = f.size("hidden_size")
    heads = f.size("num_attention_heads")
    return AttentionSpec(
        kind="mha",
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads(f, heads),
        head_dim=head_dim,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,  # type: ignore[arg-type]
        sinks=sinks,
        sliding_window=sliding_window,
        softmax_scale=softmax_scale,
        chunk_size=chunk_size,
        use_rope=use_rope,
    )


def expert_counts(f: ConfigFields, experts_key: str, top_k_key: str = "num_experts_per_tok") -> tuple[int, int]:
    """(E, K), checked: an MoE layer routes each token to between 1 and E experts."""
    num_experts = f.size(experts_key)
    top_k = f.size(top_k_key)
    if top_k > num_experts:
        raise SpecError(
            f"{f.family} config: {top_k_key} ({top_k}) exceeds the number of routed experts "
            f"{experts_key} ({num_experts})"
        )
    return num_experts, top_k


def router(num_experts: int, top_k: int, *, fp32: bool = False, **fields: object) -> RouterSpec:
    """A RouterSpec whose gate GEMM runs in the model dtype, as in every family but DeepSeek's
    (which keeps its gate weight in fp32 and builds its RouterSpec with fp32=True)."""
    return RouterSpec(num_experts=num_experts, top_k=top_k, fp32=fp32, **fields)  # type: ignore[arg-type]


def gated_mlp(hidden: int, width: int, act: Activation, bias: bool = False) -> MLPSpec:
    return MLPSpec(hidden_size=hidden, width=width, gated=True, bias=bias, activation=act)


def layer_windows(
    f: ConfigFields, num_layers: int, default_types: Sequence[str], window: Optional[int]
) -> tuple[Optional[int], ...]:
    """Per-layer sliding window from `layer_types` (given or the family's default pattern)."""
    types = f.str_list("layer_types") if f.has("layer_types") else None
    types = tuple(default_types) if types is None else types
    if len(types) != num_layers:
        raise SpecError(
            f"{f.family} config: 'layer_types' has {len(types)} entries for {num_layers} layers"
        )
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise SpecError(f"{f.family} config: unknown layer_types {unknown}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def model_spec(
    f: ConfigFields,
    name: str,
    model_type: str,
    layers: Sequence[LayerSpec],
    rope: RopeSpec,
    final_norm: NormSpec,
    **extra_fields: object,
) -> ModelSpec:
    bos, eos = token_ids(f)
    return ModelSpec(
        model_type=model_type,
        name=name,
        vocab_size=f.size("vocab_size"),
        hidden_size=f.size("hidden_size"),
        layers=tuple(layers),
        tie_word_embeddings=f.bool("tie_word_embeddings"),
        final_norm=final_norm,
        rope=rope,
        max_position_embeddings=f.size("max_position_embeddings"),
        bos_token_id=bos,
        eos_token_ids=eos,
        **extra_fields,  # type: ignore[arg-type]
    )
