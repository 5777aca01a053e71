"""Family semantics the specs must carry for the engine: routing, shared experts, multipliers,
layer patterns. Each expectation is a fact stated in the family's transformers code."""

from __future__ import annotations

import json
import math
from importlib import resources

import pytest

from moekit.errors import SpecError
from spec_fixtures import TINY
from moekit.spec import AttentionSpec, MambaSpec, MLPSpec, MoESpec, load_spec, spec_from_config
from moekit.spec.loading import supported_model_types



def tiny(model_type: str, **extra: object) -> dict:
    return {"model_type": model_type, **TINY, **extra}


def test_every_family_of_the_brief_has_an_adapter() -> None:
    wanted = {
        "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2", "gpt_oss",
        "granitemoe", "dbrx", "llama4", "phimoe", "jamba", "llama", "mistral", "qwen2", "qwen3",
    }  # fmt: skip
    assert wanted <= set(supported_model_types())


def test_mixtral_always_renormalises_over_the_k() -> None:
    spec = load_spec("mixtral-8x7b")
    moe = spec.layers[0].ffn
    assert isinstance(moe, MoESpec)
    assert (moe.num_experts, moe.top_k) == (8, 2)
    assert moe.router.normalize and moe.router.order == "score_then_topk" and moe.router.scoring == "softmax"
    assert spec.rope.theta == 1e6 and spec.final_norm.eps == 1e-5


def test_qwen_norm_topk_prob_decides_renormalisation() -> None:
    assert load_spec("qwen3-30b-a3b").layers[0].ffn.router.normalize is True
    assert load_spec("olmoe-1b-7b").layers[0].ffn.router.normalize is False
    assert load_spec("qwen1.5-moe-a2.7b").layers[0].ffn.router.normalize is False


def test_qwen2_moe_has_a_gated_shared_expert_and_sparse_step() -> None:
    spec = spec_from_config(
        tiny(
            "qwen2_moe", num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3], shared_expert_intermediate_size=24
        ),
        "t",
    )
    assert [layer.is_moe for layer in spec.layers] == [False, True, False, False]
    moe = spec.layers[1].ffn
    assert moe.shared == MLPSpec(hidden_size=32, width=24) and moe.shared_gate
    assert spec.layers[0].ffn.width == 40  # dense layers use intermediate_size


def test_only_deepseek_keeps_its_gate_gemm_in_fp32() -> None:
    assert load_spec("deepseek-v3").layers[3].ffn.router.fp32
    assert load_spec("deepseek-v2-lite").layers[1].ffn.router.fp32
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "gpt-oss-20b", "granite-3.0-1b-a400m"):
        assert not load_spec(name).layers[0].ffn.router.fp32, name


def test_qk_norm_kinds() -> None:
    assert load_spec("qwen3-30b-a3b").layers[0].mixer.qk_norm == "head"
    assert load_spec("olmoe-1b-7b").layers[0].mixer.qk_norm == "full"
    assert load_spec("mixtral-8x7b").layers[0].mixer.qk_norm is None


def test_olmoe_clip_qkv_reaches_the_extras() -> None:
    assert spec_from_config(tiny("olmoe", clip_qkv=8), "t").extra("clip_qkv") == 8.0
    assert load_spec("olmoe-1b-7b").extra("clip_qkv") is None


def test_granitemoe_multipliers_and_attention_scale() -> None:
    spec = load_spec("granite-3.0-1b-a400m")
    assert spec.layers[0].mixer.softmax_scale == 0.015625
    assert (spec.multipliers.embedding, spec.multipliers.residual, spec.multipliers.logits_scaling) == (12.0, 0.22, 6.0)
    router = spec.layers[0].ffn.router
    assert router.order == "topk_then_score" and not router.normalize
    assert spec.tie_word_embeddings


def test_gpt_oss_extras_sinks_windows_and_router() -> None:
    spec = load_spec("gpt-oss-20b")
    windows = [layer.mixer.sliding_window for layer in spec.layers]
    assert windows[:4] == [128, None, 128, None]
    assert all(layer.mixer.sinks and layer.mixer.qkv_bias and layer.mixer.o_bias for layer in spec.layers)
    moe = spec.layers[0].ffn
    assert moe.expert.activation == "swiglu_oai" and moe.expert.bias
    assert moe.router.bias and moe.router.order == "topk_then_score" and not moe.router.fp32
    assert spec.extra("swiglu_limit") == 7.0 and spec.extra("swiglu_alpha") == 1.702
    assert spec.rope.theta == 150000.0 and spec.rope.scaling_dict()["rope_type"] == "yarn"


def test_deepseek_v3_router_mla_and_mtp() -> None:
    spec = load_spec("deepseek-v3")
    assert [layer.is_moe for layer in spec.layers[:4]] == [False, False, False, True]
    assert spec.layers[0].ffn.width == 18432
    moe = spec.layers[3].ffn
    router = moe.router
    assert (router.scoring, router.normalize, router.scaling) == ("sigmoid", True, 2.5)
    assert router.selection_bias and (router.n_group, router.topk_group) == (8, 4)
    assert router.group_scoring == "top2_sum"
    assert moe.shared == MLPSpec(hidden_size=7168, width=2048) and not moe.shared_gate
    attention = spec.layers[0].mixer
    assert attention.kind == "mla" and attention.q_lora_rank == 1536 and attention.head_dim == 192
    assert spec.mtp_params > 0 and spec.extra("rope_interleave") is True


def test_deepseek_v2_lite_projects_q_directly_and_never_renormalises() -> None:
    spec = load_spec("deepseek-v2-lite")
    assert spec.layers[0].mixer.q_lora_rank is None
    router = spec.layers[1].ffn.router
    assert (router.scoring, router.normalize, router.n_group) == ("softmax", False, 1)
    assert spec.layers[1].ffn.shared.width == 2 * 1408
    assert spec.mtp_params == 0


def test_deepseek_mla_softmax_scale_carries_the_yarn_mscale() -> None:
    rope = {"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    config = json.loads(resources.files("moekit.spec").joinpath("presets/deepseek-v3.json").read_text())
    spec = spec_from_config({**config, "rope_scaling": rope}, "v3-yarn")
    mscale = 0.1 * math.log(40.0) + 1.0
    assert math.isclose(spec.layers[0].mixer.softmax_scale, 192**-0.5 * mscale * mscale)


def test_kimi_k2_is_deepseek_v3_under_its_own_name() -> None:
    config = {
        **tiny("kimi_k2", hidden_size=64), "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 8, "moe_intermediate_size": 16, "n_routed_experts": 12,
        "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.827,
    }  # fmt: skip
    spec = spec_from_config(config, "kimi")
    assert spec.model_type == "kimi_k2"
    router = spec.layers[1].ffn.router
    assert router.scoring == "sigmoid" and router.selection_bias and router.scaling == 2.827


def test_llama4_interleaving_shared_expert_and_nope_layers() -> None:
    spec = load_spec("llama-4-scout-17b-16e")
    assert all(layer.is_moe for layer in spec.layers)
    moe = spec.layers[0].ffn
    assert moe.shared == MLPSpec(hidden_size=5120, width=8192) and moe.num_shared == 1
    assert moe.router.scoring == "sigmoid" and moe.router.order == "topk_then_score" and not moe.router.normalize
    rope_layers = [layer.mixer.use_rope for layer in spec.layers[:4]]
    assert rope_layers == [True, True, True, False]
    assert spec.layers[0].mixer.qk_norm == "l2" and spec.layers[3].mixer.qk_norm is None
    assert spec.layers[0].mixer.chunk_size == 8192 and spec.layers[3].mixer.chunk_size is None
    assert spec.vision_params > 0
    config = json.loads(resources.files("moekit.spec").joinpath("presets/llama-4-scout-17b-16e.json").read_text())
    config["text_config"]["interleave_moe_layer_step"] = 2
    interleaved = spec_from_config(config, "maverick-like")
    assert [layer.is_moe for layer in interleaved.layers[:4]] == [False, True, False, True]
    assert interleaved.layers[0].ffn.width == 16384  # intermediate_size_mlp


def test_jamba_periods_place_attention_and_experts() -> None:
    config = tiny("jamba", num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=1, num_experts=4)
    spec = spec_from_config(config, "jamba")
    assert [isinstance(layer.mixer, AttentionSpec) for layer in spec.layers] == [
        False, True, False, False, False, True, False, False,
    ]  # fmt: skip
    assert [layer.is_moe for layer in spec.layers] == [i % 2 == 1 for i in range(8)]
    mamba = spec.layers[0].mixer
    assert isinstance(mamba, MambaSpec) and mamba.d_inner == 64 and mamba.dt_rank == 2  # ceil(32 / 16)


def test_dbrx_reads_its_nested_configs() -> None:
    config = {
        "model_type": "dbrx", "vocab_size": 97, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64,
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8},
        "ffn_config": {"ffn_hidden_size": 24, "moe_num_experts": 16, "moe_top_k": 4},
    }  # fmt: skip
    spec = spec_from_config(config, "dbrx")
    assert spec.num_layers == 2 and spec.max_position_embeddings == 64
    assert spec.layers[0].mixer.num_kv_heads == 2 and spec.extra("clip_qkv") == 8.0
    moe = spec.layers[0].ffn
    assert (moe.num_experts, moe.top_k, moe.expert.width) == (16, 4, 24)
    assert spec.final_norm.kind == "layer" and not spec.final_norm.bias


def test_rope_styles_old_and_new_give_one_spec() -> None:
    old = tiny("llama", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0})
    new = tiny("llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5})
    assert spec_from_config(old, "a").rope == spec_from_config(new, "b").rope
    assert spec_from_config(new, "b").rope.scaling_dict() == {"rope_type": "linear", "factor": 4.0}
    assert spec_from_config(tiny("llama"), "c").rope.scaling is None


def test_eos_as_list_or_int() -> None:
    assert spec_from_config(tiny("llama", eos_token_id=[5, 9]), "t").eos_token_ids == (5, 9)
    assert spec_from_config(tiny("llama", eos_token_id=5), "t").eos_token_ids == (5,)
    assert spec_from_config(tiny("qwen3"), "t").eos_token_ids == ()  # Qwen3Config's default: None


def test_missing_fields_take_the_family_default() -> None:
    # mixtral's defaults: 8 experts, top-2, 8 kv heads, head_dim = hidden // heads
    config = {
        "model_type": "mixtral", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8
    }
    spec = spec_from_config(config, "t")
    moe = spec.layers[0].ffn
    attention = spec.layers[0].mixer
    assert (moe.num_experts, moe.top_k, attention.num_kv_heads, attention.head_dim) == (8, 2, 8, 8)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (tiny("deepseek_v3", n_routed_experts=10, n_group=4), "n_group"),
        (tiny("deepseek_v3", n_routed_experts=8, n_group=2, topk_group=3), "topk_group"),
        (tiny("jamba", attn_layer_offset=9), "attn_layer_offset"),
        (tiny("mixtral", num_key_value_heads=3), "num_key_value_heads"),
        (tiny("gpt_oss", layer_types=["full_attention"]), "layer_types"),
        (tiny("mixtral", hidden_act="relu6"), "hidden_act"),
    ],
)
def test_impossible_family_settings_are_refused_by_name(config: dict, needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        spec_from_config(config, "t")
