"""dbrx: fused Wqkv attention with clip_qkv, bias-free LayerNorms, softmax top-K router whose K
weights are divided by their p-norm (p = moe_normalize_expert_weights; 1 = plain sum).

Top-level names are d_model / n_heads / n_layers / max_seq_len; attention and experts live in
`attn_config` and `ffn_config`. transformers 5.24 rotates with the top-level rope settings and never
reads `attn_config.rope_theta` (DBRX's own 500000) for its rotary embedding; we follow it, since it
is the reference the engine is checked against.
"""

from __future__ import annotations

from moekit.errors import SpecError
from moekit.spec.adapters import common
from moekit.spec.model_spec import AttentionSpec, LayerSpec, ModelSpec, MoESpec, NormSpec
from moekit.spec.rope import rope_spec

DEFAULTS = {
    "max_position_embeddings": 2048,
    "bos_token_id": None,
    "eos_token_id": None,
    "tie_word_embeddings": False,
    "attn_config": None,
    "ffn_config": None,
}
ATTN_DEFAULTS = {"clip_qkv": None, "kv_n_heads": 1}
FFN_DEFAULTS = {
    "ffn_act_fn": None,
    "ffn_hidden_size": 3584,
    "moe_num_experts": 4,
    "moe_top_k": 1,
    "moe_normalize_expert_weights": 1.0,
}
DEFAULT_THETA = 10000.0
_ALIASES = {
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_layers": "num_hidden_layers",
    "max_seq_len": "max_position_embeddings",
}
# nn.LayerNorm(d_model, bias=False) at its default eps.
_NORM = NormSpec(kind="layer", eps=1e-5, bias=False)


def build(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, DEFAULTS, "dbrx", _ALIASES)
    if f.bool("tie_word_embeddings"):
        raise SpecError("dbrx config: tie_word_embeddings is not supported for DBRX (transformers refuses it)")
    attn = f.sub("attn_config", ATTN_DEFAULTS, "dbrx.attn_config")
    ffn = f.sub("ffn_config", FFN_DEFAULTS, "dbrx.ffn_config")
    hidden, heads = f.size("hidden_size"), f.size("num_attention_heads")
    kv = attn.size("kv_n_heads")
    if heads % kv:
        raise SpecError(f"dbrx config: n_heads ({heads}) is not a multiple of attn_config.kv_n_heads ({kv})")
    attention = AttentionSpec(
        kind="mha", hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads
    )
    act_fn = ffn.get("ffn_act_fn") or {"name": "silu"}
    if not isinstance(act_fn, dict):
        raise SpecError(f"dbrx config: 'ffn_config.ffn_act_fn' must be an object, got {act_fn!r}")
    act = common.activation(common.fields({"hidden_act": act_fn.get("name", "silu")}, {}, "dbrx.ffn_config.ffn_act_fn"))
    num_experts, top_k = common.expert_counts(ffn, "moe_num_experts", "moe_top_k")
    norm_p = ffn.opt_float("moe_normalize_expert_weights")
    router = common.router(num_experts=num_experts, top_k=top_k, normalize=norm_p is not None, norm_p=norm_p)
    moe = MoESpec(router=router, expert=common.gated_mlp(hidden, ffn.size("ffn_hidden_size"), act))
    layers = [LayerSpec(mixer=attention, ffn=moe, norm=_NORM)] * f.size("num_hidden_layers")
    extras: tuple = (("fused_qkv", True),)
    clip = attn.opt_float("clip_qkv")
    if clip is not None:
        extras += (("clip_qkv", clip),)
    if norm_p is not None and norm_p != 1.0:
        extras += (("router_norm_p", norm_p),)
    return common.model_spec(f, name, "dbrx", layers, rope_spec(f, DEFAULT_THETA), _NORM, extras=extras)
