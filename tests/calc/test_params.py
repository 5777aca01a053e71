"""Parameter counts against the oracle: transformers itself, instantiated on the meta device.

For every family, the decoder total must equal `sum(p.numel())` over the text CausalLM that
transformers 5.24 builds from the same config dict, to the parameter; llama4's vision tower and
projector must equal what Llama4ForConditionalGeneration adds on top.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    Llama4Config,
    Llama4ForConditionalGeneration,
)

from moekit.calc.params import count_params
from moekit.spec import list_presets, spec_from_config
from moekit.spec.loading import preset_config



def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def hf_counts(config: dict) -> tuple[int, int]:
    """(text decoder parameters, vision parameters) of the model transformers builds."""
    kwargs = copy.deepcopy(config)
    model_type = kwargs.pop("model_type")
    with torch.device("meta"):
        if model_type == "llama4":
            model = Llama4ForConditionalGeneration(Llama4Config(**kwargs))
            text = _numel(model.language_model)  # a Llama4ForCausalLM, head included
            return text, _numel(model) - text
        # Kimi K2 ships the DeepSeek-V3 architecture under its own model_type.
        if model_type == "kimi_k2":
            hf_config = DeepseekV3Config(**kwargs)
        else:
            hf_config = AutoConfig.for_model(model_type, **kwargs)
        return _numel(AutoModelForCausalLM.from_config(hf_config)), 0


def ours(config: dict) -> tuple[int, int]:
    counts = count_params(spec_from_config(config, "test"))
    return counts.total_params, counts.breakdown.vision


def with_changes(config: dict, **changes: object) -> dict:
    out = copy.deepcopy(config)
    for key, value in changes.items():
        if "__" in key:  # nested: text_config__num_local_experts
            outer, inner = key.split("__", 1)
            out[outer][inner] = value
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_matches_transformers(name: str) -> None:
    config = preset_config(name)
    assert ours(config) == hf_counts(config)


# Perturbed real presets: the traps each family's code sets (dense/MoE interleaving, shared
# experts on/off, tied heads, other E and K).
PERTURBED = [
    ("mixtral-8x7b", {"num_local_experts": 4, "num_experts_per_tok": 1}),
    ("mixtral-8x7b", {"tie_word_embeddings": True, "head_dim": None}),
    ("mixtral-8x22b", {"num_local_experts": 16, "num_experts_per_tok": 4}),
    ("qwen3-30b-a3b", {"mlp_only_layers": [0, 5, 47]}),
    ("qwen3-30b-a3b", {"decoder_sparse_step": 2, "num_experts_per_tok": 2, "tie_word_embeddings": True}),
    ("qwen3-235b-a22b", {"num_experts": 64, "attention_bias": True, "head_dim": 64}),
    ("qwen1.5-moe-a2.7b", {"decoder_sparse_step": 3, "mlp_only_layers": [1]}),
    ("qwen1.5-moe-a2.7b", {"shared_expert_intermediate_size": 0, "qkv_bias": False}),
    ("qwen1.5-moe-a2.7b", {"num_experts": 0}),
    ("olmoe-1b-7b", {"num_experts_per_tok": 2, "tie_word_embeddings": True, "attention_bias": True}),
    ("olmoe-1b-7b", {"num_experts": 32, "num_key_value_heads": 4}),
    ("granite-3.0-1b-a400m", {"tie_word_embeddings": False, "num_local_experts": 40, "attention_bias": True}),
    ("gpt-oss-20b", {"num_local_experts": 16, "tie_word_embeddings": True, "attention_bias": False}),
    ("gpt-oss-120b", {"num_experts_per_tok": 8, "head_dim": 80}),
    ("deepseek-v3", {"first_k_dense_replace": 0, "n_shared_experts": 2}),
    ("deepseek-v3", {"n_shared_experts": 0, "q_lora_rank": None, "attention_bias": True, "tie_word_embeddings": True}),
    ("deepseek-v3", {"first_k_dense_replace": 10, "n_routed_experts": 64, "num_nextn_predict_layers": 2}),
    ("deepseek-v2-lite", {"q_lora_rank": 768, "first_k_dense_replace": 0}),
    ("deepseek-v2-lite", {"n_shared_experts": 0, "mlp_bias": True, "attention_bias": True}),
    ("deepseek-v2-lite", {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}),
    ("llama-4-scout-17b-16e", {"text_config__interleave_moe_layer_step": 2}),
    ("llama-4-scout-17b-16e", {"text_config__moe_layers": [1, 7, 30], "text_config__num_local_experts": 8}),
    ("llama-4-scout-17b-16e", {"text_config__tie_word_embeddings": True, "text_config__attention_bias": True}),
]


@pytest.mark.parametrize(("name", "changes"), PERTURBED, ids=[f"{n}-{sorted(c)}" for n, c in PERTURBED])
def test_perturbed_presets_match_transformers(name: str, changes: dict) -> None:
    config = with_changes(preset_config(name), **changes)
    assert ours(config) == hf_counts(config)


def _tiny(model_type: str, **extra: object) -> dict:
    base = {
        "model_type": model_type,
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    base.update(extra)
    return base


_MLA = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "moe_intermediate_size": 16,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
}
_DBRX = {
    "model_type": "dbrx",
    "vocab_size": 97,
    "d_model": 32,
    "n_heads": 4,
    "n_layers": 2,
    "max_seq_len": 64,
    "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 500000},
    "ffn_config": {"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2},
}
_JAMBA = _tiny(
    "jamba",
    num_hidden_layers=8,
    attn_layer_period=4,
    attn_layer_offset=1,
    expert_layer_period=2,
    expert_layer_offset=1,
    num_experts=4,
    num_experts_per_tok=2,
)
_LLAMA4 = {
    "model_type": "llama4",
    "text_config": {
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 24,
        "intermediate_size_mlp": 56,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
    },
    "vision_config": {
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": 4,
        "image_size": 16,
        "vision_output_dim": 20,
        "projector_input_dim": 20,
        "projector_output_dim": 20,
    },
}

# Families with no bundled preset, and variants of those with one, built small.
SYNTHETIC = {
    "llama": _tiny("llama"),
    "llama-biases-tied": _tiny("llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "llama-head-dim": _tiny("llama", head_dim=16, num_key_value_heads=None),
    "mistral": _tiny("mistral"),
    "mistral-head-dim-tied": _tiny("mistral", head_dim=12, tie_word_embeddings=True, sliding_window=None),
    "qwen2": _tiny("qwen2"),
    "qwen2-tied-sliding": _tiny("qwen2", tie_word_embeddings=True, use_sliding_window=True, max_window_layers=1),
    "qwen3": _tiny("qwen3"),
    "qwen3-head-dim-bias": _tiny("qwen3", head_dim=16, attention_bias=True, tie_word_embeddings=True),
    "qwen3_moe": _tiny("qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12),
    "qwen2_moe": _tiny(
        "qwen2_moe", num_experts=6, num_experts_per_tok=3, moe_intermediate_size=12, shared_expert_intermediate_size=20
    ),
    "mixtral": _tiny("mixtral", num_local_experts=3, num_experts_per_tok=3),
    "olmoe": _tiny("olmoe", num_experts=5, num_experts_per_tok=2, num_key_value_heads=None),
    "granitemoe": _tiny("granitemoe", num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True),
    "gpt_oss": _tiny("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=8),
    "dbrx": _DBRX,
    "dbrx-more-experts": with_changes(_DBRX, ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 1}),
    "phimoe": _tiny("phimoe", num_local_experts=4, num_experts_per_tok=2),
    "phimoe-head-bias": _tiny("phimoe", num_local_experts=4, lm_head_bias=True, attention_bias=True),
    "phimoe-tied-head-bias": _tiny("phimoe", num_local_experts=4, lm_head_bias=True, tie_word_embeddings=True),
    "jamba": _JAMBA,
    "jamba-dense": with_changes(_JAMBA, num_experts=1, tie_word_embeddings=True),
    "jamba-mamba-options": with_changes(
        _JAMBA, mamba_dt_rank=5, mamba_proj_bias=True, mamba_conv_bias=False, mamba_expand=3, attn_layer_offset=0
    ),
    "deepseek_v3": _tiny("deepseek_v3", **_MLA, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3),
    "deepseek_v3-no-q-lora": _tiny(
        "deepseek_v3",
        **{**_MLA, "q_lora_rank": None},
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=0,
    ),
    "kimi_k2": _tiny(
        "kimi_k2",
        **_MLA,
        n_routed_experts=12,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        num_nextn_predict_layers=0,
    ),
    "deepseek_v2-lite": _tiny(
        "deepseek_v2", **{**_MLA, "q_lora_rank": None}, num_experts_per_tok=2, first_k_dense_replace=1
    ),
    "deepseek_v2-grouped": _tiny(
        "deepseek_v2",
        **_MLA,
        n_routed_experts=8,
        num_experts_per_tok=2,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
    ),
    "deepseek_v2-biases": _tiny(
        "deepseek_v2", **_MLA, n_routed_experts=4, num_experts_per_tok=1, mlp_bias=True, attention_bias=True
    ),
    "llama4": _LLAMA4,
    "llama4-all-moe-tied": with_changes(
        _LLAMA4, text_config__interleave_moe_layer_step=1, text_config__tie_word_embeddings=True
    ),
}


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_synthetic_configs_match_transformers(name: str) -> None:
    config = SYNTHETIC[name]
    assert ours(config) == hf_counts(config)


def test_llama4_text_only_config_matches_its_causal_lm() -> None:
    text = {"model_type": "llama4_text", **_LLAMA4["text_config"]}
    assert ours(text) == hf_counts(text)


def test_vision_and_mtp_stay_out_of_the_totals() -> None:
    scout = count_params(spec_from_config(preset_config("llama-4-scout-17b-16e"), "scout"))
    v3 = count_params(spec_from_config(preset_config("deepseek-v3"), "v3"))
    assert scout.breakdown.vision > 0 and v3.breakdown.mtp > 0
    for counts in (scout, v3):
        b = counts.breakdown
        parts = (
            b.embedding + b.attention + b.router + b.routed_experts_total + b.shared_experts + b.dense_mlp
            + b.norms + b.head + b.mamba
        )
        assert parts == counts.total_params


def test_tied_table_is_counted_once_and_kept_as_the_head() -> None:
    untied = count_params(spec_from_config(_tiny("llama"), "untied"))
    tied = count_params(spec_from_config(_tiny("llama", tie_word_embeddings=True), "tied"))
    table = 97 * 32
    assert untied.total_params - tied.total_params == table
    assert tied.breakdown.head == 0
    # excluding the input embedding leaves the tied table in, as the output head
    assert tied.active_params_excl_input_embedding == tied.active_params
    assert untied.active_params_excl_input_embedding == untied.active_params - table
    assert tied.active_params_non_embedding == untied.active_params_non_embedding
