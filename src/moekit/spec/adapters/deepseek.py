"""DeepSeek-V2 / V3 and Kimi K2 (the V3 architecture under model_type "kimi_k2").

Latent attention (MLA); the first `first_k_dense_replace` layers dense with `intermediate_size`,
the rest MoE with ungated shared experts fused into one MLP of n_shared × moe_intermediate_size.
transformers builds every layer from first_k_dense_replace on as MoE and ignores `moe_layer_freq`;
so do we. V3's multi-token-prediction layers (`num_nextn_predict_layers`) are not part of the
decoder transformers builds: they are counted into `mtp_params`, apart.
"""

from __future__ import annotations

from moekit.errors import SpecError
from moekit.spec.adapters import common
from moekit.spec.config_fields import ConfigFields
from moekit.spec.layer_counts import layer_params
from moekit.spec.model_spec import AttentionSpec, LayerSpec, ModelSpec, MoESpec, RopeSpec, RouterSpec
from moekit.spec.rope import rope_spec, yarn_softmax_scale

V3_DEFAULTS = {
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
    "num_nextn_predict_layers": 1,
}
V2_DEFAULTS = {
    "intermediate_size": 11008,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "n_group": None,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "routed_scaling_factor": 1.0,
    "topk_group": None,
    "topk_method": "greedy",
    "v_head_dim": 128,
    "num_experts_per_tok": None,
    "moe_intermediate_size": 1407,
}
DEFAULT_THETA = 10000.0
_V3_ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
_V2_ALIASES = {"num_experts": "n_routed_experts"}


def _mla(f: ConfigFields, rope: RopeSpec) -> AttentionSpec:
    heads = f.size("num_attention_heads")
    nope, rope_dim = f.size("qk_nope_head_dim"), f.size("qk_rope_head_dim")
    bias = f.bool("attention_bias")
    # MLA's bias (attention_bias) sits on q_a_proj, kv_a_proj_with_mqa and o_proj only.
    return AttentionSpec(
        kind="mla",
        hidden_size=f.size("hidden_size"),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + rope_dim,
        qkv_bias=bias,
        o_bias=bias,
        q_lora_rank=f.opt_size("q_lora_rank"),
        kv_lora_rank=f.size("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=f.size("v_head_dim"),
        softmax_scale=yarn_softmax_scale(rope, nope + rope_dim),
    )


def _check_groups(f: ConfigFields, router: RouterSpec) -> None:
    e, k, groups, kept = router.num_experts, router.top_k, router.n_group, router.topk_group
    if e % groups:
        raise SpecError(f"{f.family} config: n_routed_experts ({e}) is not a multiple of n_group ({groups})")
    if kept > groups:
        raise SpecError(f"{f.family} config: topk_group ({kept}) exceeds n_group ({groups})")
    if k > kept * (e // groups):
        raise SpecError(
            f"{f.family} config: num_experts_per_tok ({k}) exceeds the {kept * (e // groups)} experts "
            f"in the topk_group ({kept}) groups kept"
        )
    if router.group_scoring == "top2_sum" and e // groups < 2:
        raise SpecError(f"{f.family} config: each of the n_group ({groups}) groups needs at least 2 experts")


def _layers(f: ConfigFields, attention: AttentionSpec, router: RouterSpec, mlp_bias: bool) -> list[LayerSpec]:
    hidden = f.size("hidden_size")
    act = common.activation(f)
    moe_width = f.size("moe_intermediate_size")
    n_shared = f.int("n_shared_experts") or 0
    if n_shared < 0:
        raise SpecError(f"{f.family} config: 'n_shared_experts' must not be negative, got {n_shared}")
    # transformers builds the shared MLP even for n_shared = 0; only its down_proj bias is then
    # left (width 0), and it is still added to every token's output.
    shared = common.gated_mlp(hidden, n_shared * moe_width, act, bias=mlp_bias) if n_shared or mlp_bias else None
    # Routed experts never carry a bias (mlp_bias reaches only the dense and shared MLPs).
    moe = MoESpec(router=router, expert=common.gated_mlp(hidden, moe_width, act), shared=shared, num_shared=n_shared)
    num_layers = f.size("num_hidden_layers")
    first_moe = f.int("first_k_dense_replace")
    dense = common.gated_mlp(hidden, f.size("intermediate_size"), act, bias=mlp_bias) if first_moe > 0 else None
    norm = common.rms_norm(f)
    return [
        LayerSpec(mixer=attention, ffn=moe if i >= first_moe else dense, norm=norm)  # type: ignore[arg-type]
        for i in range(num_layers)
    ]


def _mtp_params(f: ConfigFields, moe_layer: LayerSpec) -> int:
    """One MTP module as DeepSeek ships it: enorm, hnorm, eh_proj (2D → D), one MoE decoder layer,
    shared_head norm + head, and its own copy of the embedding table (the Hub's 685B counts it)."""
    depth = f.int("num_nextn_predict_layers") or 0
    if depth <= 0:
        return 0
    hidden, vocab = f.size("hidden_size"), f.size("vocab_size")
    per_module = layer_params(moe_layer).total + 2 * hidden * hidden + 3 * hidden + 2 * vocab * hidden
    return depth * per_module


def _build_v3(config: dict, name: str, model_type: str) -> ModelSpec:
    f = common.fields(config, V3_DEFAULTS, model_type, _V3_ALIASES)
    rope = rope_spec(f, DEFAULT_THETA)
    num_experts, top_k = common.expert_counts(f, "n_routed_experts")
    router = RouterSpec(
        num_experts=num_experts,
        top_k=top_k,
        scoring="sigmoid",
        normalize=f.bool("norm_topk_prob"),
        scaling=f.float("routed_scaling_factor"),
        selection_bias=True,
        fp32=True,  # the gate weight is kept in fp32 and its GEMM runs there
        n_group=f.size("n_group"),
        topk_group=f.size("topk_group"),
    )
    _check_groups(f, router)
    layers = _layers(f, _mla(f, rope), router, mlp_bias=False)
    moe_layers = [layer for layer in layers if layer.is_moe]
    mtp = _mtp_params(f, moe_layers[0]) if moe_layers else 0
    extras = (("rope_interleave", f.bool("rope_interleave")),)
    return common.model_spec(f, name, model_type, layers, rope, common.rms_norm(f), mtp_params=mtp, extras=extras)


def build_v3(config: dict, name: str) -> ModelSpec:
    return _build_v3(config, name, "deepseek_v3")


def build_kimi_k2(config: dict, name: str) -> ModelSpec:
    return _build_v3(config, name, "kimi_k2")


def build_v2(config: dict, name: str) -> ModelSpec:
    f = common.fields(config, V2_DEFAULTS, "deepseek_v2", _V2_ALIASES)
    rope = rope_spec(f, DEFAULT_THETA)
    num_experts, top_k = common.expert_counts(f, "n_routed_experts")
    method = f.str("topk_method")
    if method not in ("greedy", "group_limited_greedy"):
        raise SpecError(f"deepseek_v2 config: topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    # DeepseekV2TopkRouter: softmax over E, top-K, × routed_scaling_factor, never renormalised
    # (transformers ignores scoring_func and norm_topk_prob for V2).
    router = RouterSpec(
        num_experts=num_experts,
        top_k=top_k,
        normalize=False,
        scaling=f.float("routed_scaling_factor"),
        n_group=f.size("n_group") if grouped else 1,
        topk_group=f.size("topk_group") if grouped else 1,
        group_scoring="max",
        fp32=True,
    )
    _check_groups(f, router)
    layers = _layers(f, _mla(f, rope), router, mlp_bias=f.bool("mlp_bias"))
    # V2 rotates interleaved pairs (complex multiply), the layout V3 calls rope_interleave.
    extras = (("rope_interleave", True),)
    return common.model_spec(f, name, "deepseek_v2", layers, rope, common.rms_norm(f), extras=extras)
