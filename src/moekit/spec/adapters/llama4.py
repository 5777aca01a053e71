"""llama4: text decoder under `text_config`, vision tower + projector counted in `vision_params`.

MoE layers are `moe_layers` or every `interleave_moe_layer_step`-th layer; dense layers use
`intermediate_size_mlp`, experts and the always-on shared expert `intermediate_size`. The router
takes top-K of the logits and a sigmoid of those (no renormalisation), and scales the expert INPUT
(MoESpec.weigh_input). Every `no_rope_layer_interval`-th layer is NoPE (full attention, queries
temperature-tuned: AttentionSpec.query_temperature); the others rotate adjacent pairs as complex
numbers in fp32 (RopeSpec.interleaved, .fp32), L2-normalise q/k after that and attend within
`attention_chunk_size` chunks.
"""

from __future__ import annotations

from dataclasses import replace

from moekit.errors import SpecError
from moekit.spec.adapters import common
from moekit.spec.config_fields import ConfigFields
from moekit.spec.model_spec import LayerSpec, ModelSpec, MoESpec
from moekit.spec.rope import rope_spec

TEXT_DEFAULTS = {
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "moe_layers": None,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layers": None,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "layer_types": None,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
}
VISION_DEFAULTS = {
    "hidden_size": 768,
    "num_hidden_layers": 34,
    "num_attention_heads": 16,
    "num_channels": 3,
    "intermediate_size": 5632,
    "vision_output_dim": 7680,
    "image_size": 448,
    "patch_size": 14,
    "projector_input_dim": 4096,
    "projector_output_dim": 4096,
}
DEFAULT_THETA = 500000.0


def vision_params(v: ConfigFields, text_hidden: int) -> int:
    """Llama4VisionModel + Llama4MultiModalProjector, as transformers builds them."""
    hidden, inner = v.size("hidden_size"), v.size("intermediate_size")
    patch = v.size("patch_size")
    patches = (v.size("image_size") // patch) ** 2 + 1  # + the class token
    p = v.size("num_channels") * patch * patch * hidden  # unfold-conv patch embedding, no bias
    p += hidden + patches * hidden  # class embedding, positional embedding
    p += 2 * 2 * hidden  # layernorm_pre / _post (LayerNorm with bias)
    per_layer = 4 * (hidden * hidden + hidden) + (hidden * inner + inner) + (inner * hidden + hidden) + 2 * 2 * hidden
    p += v.size("num_hidden_layers") * per_layer
    p += inner * v.size("projector_input_dim") + v.size("projector_output_dim") ** 2  # pixel-shuffle MLP
    p += v.size("vision_output_dim") * text_hidden  # multi_modal_projector
    return p


def _layers(t: ConfigFields) -> list[LayerSpec]:
    hidden, heads, num_layers = t.size("hidden_size"), t.size("num_attention_heads"), t.size("num_hidden_layers")
    step = t.size("interleave_moe_layer_step")
    listed = t.get("moe_layers") is not None
    moe_at = set(t.int_list("moe_layers")) if listed else set(range(step - 1, num_layers, step))
    interval = t.size("no_rope_layer_interval")
    rope_on = t.int_list("no_rope_layers") or tuple(int((i + 1) % interval != 0) for i in range(num_layers))
    if len(rope_on) < num_layers:
        raise SpecError(f"{t.family} config: 'no_rope_layers' has {len(rope_on)} entries for {num_layers} layers")
    chunk = t.opt_size("attention_chunk_size")
    types = t.str_list("layer_types") or tuple(
        "chunked_attention" if rope_on[i] and chunk is not None else "full_attention" for i in range(num_layers)
    )
    bias, qk_norm = t.bool("attention_bias"), t.bool("use_qk_norm")
    head_dim = common.head_dim(t, hidden, heads)
    act = common.activation(t)
    num_experts, top_k = common.expert_counts(t, "num_local_experts")
    moe = MoESpec(
        router=common.router(
            num_experts=num_experts, top_k=top_k, scoring="sigmoid", order="topk_then_score", normalize=False
        ),
        expert=common.gated_mlp(hidden, t.size("intermediate_size"), act),
        shared=common.gated_mlp(hidden, t.size("intermediate_size"), act),
        num_shared=1,
        weigh_input=True,
    )
    dense = common.gated_mlp(hidden, t.size("intermediate_size_mlp"), act)
    norm = common.rms_norm(t)
    tuning = t.bool("attn_temperature_tuning")
    temperature = (t.float("floor_scale"), t.float("attn_scale"))
    layers = []
    for i in range(num_layers):
        use_rope = bool(rope_on[i])
        attention = common.mha(
            t,
            head_dim=head_dim,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="l2" if qk_norm and use_rope else None,
            chunk_size=chunk if types[i] == "chunked_attention" else None,
            use_rope=use_rope,
        )
        if tuning and not use_rope:
            attention = replace(attention, query_temperature=temperature)
        layers.append(LayerSpec(mixer=attention, ffn=moe if i in moe_at else dense, norm=norm))
    return layers


def _text_spec(t: ConfigFields, name: str, model_type: str, vision: int) -> ModelSpec:
    # Complex rotation of adjacent pairs, computed in fp32 (transformers' apply_rotary_emb).
    rope = replace(rope_spec(t, DEFAULT_THETA), interleaved=True, fp32=True)
    return common.model_spec(
        t, name, model_type, _layers(t), rope, common.rms_norm(t), vision_params=vision
    )


def build(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, {"text_config": None, "vision_config": None}, "llama4")
    text = f.sub("text_config", TEXT_DEFAULTS, "llama4.text_config")
    vision = f.sub("vision_config", VISION_DEFAULTS, "llama4.vision_config")
    return _text_spec(text, name, "llama4", vision_params(vision, text.size("hidden_size")))


def build_text(config: dict, name: str) -> ModelSpec:
    return _text_spec(common.fields(config, TEXT_DEFAULTS, "llama4_text"), name, "llama4_text", 0)
