"""Every ModelSpec field the engine reads, checked against the model transformers builds.

The oracle is the live transformers module tree (on the meta device): which layers hold experts,
each attention's softmax scale and sliding window, the merged rope parameters, norm eps, tying,
token ids. A spec that disagrees would make the engine compute a different model.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    Llama4Config,
    Llama4ForConditionalGeneration,
)

from spec_fixtures import TINY
from moekit.spec import AttentionSpec, ModelSpec, list_presets, spec_from_config
from moekit.spec.loading import preset_config



def hf_model(config: dict) -> tuple[torch.nn.Module, torch.nn.Module, list[torch.nn.Module]]:
    """(causal LM, its decoder body, the body's layers) built on the meta device."""
    kwargs = copy.deepcopy(config)
    model_type = kwargs.pop("model_type")
    with torch.device("meta"):
        if model_type == "llama4":
            lm = Llama4ForConditionalGeneration(Llama4Config(**kwargs)).language_model
        else:
            # Kimi K2 ships the DeepSeek-V3 architecture under its own model_type.
            if model_type == "kimi_k2":
                hf_config = DeepseekV3Config(**kwargs)
            else:
                hf_config = AutoConfig.for_model(model_type, **kwargs)
            lm = AutoModelForCausalLM.from_config(hf_config)
    body = lm.model if hasattr(lm, "model") else lm.transformer
    layers = list(body.layers if hasattr(body, "layers") else body.blocks)
    return lm, body, layers


def _modules_named(layer: torch.nn.Module, suffix: str) -> list[torch.nn.Module]:
    return [m for m in layer.modules() if type(m).__name__.endswith(suffix)]


def _expected_scale(a: AttentionSpec) -> float:
    return a.softmax_scale if a.softmax_scale is not None else a.head_dim**-0.5


def _eps(norm: torch.nn.Module) -> float:
    return getattr(norm, "variance_epsilon", None) or norm.eps


def _hf_window(attention: torch.nn.Module, body: torch.nn.Module, hf_config: object) -> object:
    """The window this layer attends within: mixtral-like families apply the config's window to
    every layer (through one shared mask or the kernel); the others keep a per-layer attribute,
    absent or None meaning full attention."""
    shared_mask = "self.config.sliding_window is None" in inspect.getsource(type(body).forward)
    kernel_reads_config = 'self.config, "sliding_window"' in inspect.getsource(type(attention).forward)
    if shared_mask or kernel_reads_config:
        return getattr(hf_config, "sliding_window", None)
    return getattr(attention, "sliding_window", None) or None


def _rope_matches(spec: ModelSpec, hf_config: object) -> None:
    params = dict(hf_config.rope_parameters)
    assert spec.rope.theta == params.pop("rope_theta")
    assert spec.rope.partial_rotary_factor == params.pop("partial_rotary_factor", 1.0)
    params.pop("type", None)
    if params["rope_type"] == "default":
        assert spec.rope.scaling is None
    else:
        assert spec.rope.scaling_dict() == params


def check_against_transformers(config: dict) -> None:
    spec = spec_from_config(config, "test")
    lm, body, layers = hf_model(config)
    hf_config = lm.config
    assert spec.num_layers == len(layers)
    for i, (ours, theirs) in enumerate(zip(spec.layers, layers)):
        assert ours.is_moe == bool(_modules_named(theirs, "Experts")), f"layer {i}"
        top_ks = {m.top_k for m in theirs.modules() if isinstance(getattr(m, "top_k", None), int)}
        if ours.is_moe:
            assert top_ks == {ours.ffn.top_k}, f"layer {i}"
        attentions = [m for m in _modules_named(theirs, "Attention") if hasattr(m, "scaling")]
        assert isinstance(ours.mixer, AttentionSpec) == bool(attentions), f"layer {i}"
        if attentions:
            attention = attentions[0]
            assert math.isclose(_expected_scale(ours.mixer), attention.scaling, rel_tol=1e-12), f"layer {i}"
            assert ours.mixer.sliding_window == _hf_window(attention, body, hf_config), f"layer {i}"
            if hasattr(attention, "use_rope"):
                assert ours.mixer.use_rope == bool(attention.use_rope)
    if hasattr(hf_config, "rope_parameters"):
        _rope_matches(spec, hf_config)
    else:  # jamba: no rotary embedding at all
        assert not any(isinstance(a, AttentionSpec) and a.use_rope for a in (layer.mixer for layer in spec.layers))
    final_names = ("norm", "norm_f", "final_layernorm")
    final_norm = [m for name, m in lm.named_modules() if name.split(".")[-1] in final_names][0]
    assert math.isclose(spec.final_norm.eps, _eps(final_norm))
    tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    assert spec.tie_word_embeddings == tied
    assert spec.max_position_embeddings == hf_config.max_position_embeddings
    assert spec.bos_token_id == hf_config.bos_token_id
    eos = hf_config.eos_token_id
    assert spec.eos_token_ids == (() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,))


@pytest.mark.parametrize("name", list_presets())
def test_presets_describe_the_model_transformers_builds(name: str) -> None:
    check_against_transformers(preset_config(name))


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale_all_dim": 1.0}
_MLA = {
    **TINY,
    "hidden_size": 64,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
}

VARIANTS = {
    "mixtral-window-eos-list": {**TINY, "model_type": "mixtral", "sliding_window": 16, "eos_token_id": [2, 7]},
    "mixtral-old-rope-style": {
        **TINY,
        "model_type": "mixtral",
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    "qwen3_moe-sliding-sparse-step": {
        **TINY,
        "model_type": "qwen3_moe",
        "use_sliding_window": True,
        "sliding_window": 8,
        "decoder_sparse_step": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe-sliding": {
        **TINY,
        "model_type": "qwen2_moe",
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 3,
        "num_experts": 4,
        "mlp_only_layers": [2],
    },
    "qwen2_moe-layer-types": {
        **TINY,
        "model_type": "qwen2_moe",
        "use_sliding_window": True,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "num_experts": 4,
    },
    "qwen3-sliding": {
        **TINY, "model_type": "qwen3", "use_sliding_window": True, "max_window_layers": 2, "head_dim": 8
    },
    "qwen2-new-rope-style": {
        **TINY,
        "model_type": "qwen2",
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
    },
    "olmoe": {**TINY, "model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0},
    "granitemoe": {**TINY, "model_type": "granitemoe", "attention_multiplier": 0.03, "num_local_experts": 4},
    "gpt_oss-layer-types": {
        **TINY,
        "model_type": "gpt_oss",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 8,
        "sliding_window": 16,
        "layer_types": ["full_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_scaling": {
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16.0
        },
        "rope_theta": 2e5,
    },
    "llama-llama3-rope": {
        **TINY,
        "model_type": "llama",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rope_theta": 5e5,
    },
    "mistral-default-window": {**TINY, "model_type": "mistral"},
    "deepseek_v3-yarn-mscale": {
        **_MLA,
        "model_type": "deepseek_v3",
        "first_k_dense_replace": 1,
        "rope_scaling": _YARN,
    },
    "kimi_k2": {**_MLA, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0},
    "deepseek_v2-yarn": {**_MLA, "model_type": "deepseek_v2", "q_lora_rank": None, "rope_scaling": _YARN},
    "phimoe-window": {**TINY, "model_type": "phimoe", "num_local_experts": 4, "sliding_window": 16},
    "jamba": {
        **TINY,
        "model_type": "jamba",
        "num_hidden_layers": 6,
        "attn_layer_period": 3,
        "attn_layer_offset": 2,
        "num_experts": 4,
    },
    "dbrx": {
        "model_type": "dbrx",
        "vocab_size": 97,
        "d_model": 32,
        "n_heads": 4,
        "n_layers": 2,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000},
        "ffn_config": {"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "llama4-nope-chunks": {
        "model_type": "llama4",
        "text_config": {
            **TINY,
            "num_hidden_layers": 8,
            "head_dim": 8,
            "intermediate_size_mlp": 48,
            "num_local_experts": 4,
            "interleave_moe_layer_step": 2,
            "attention_chunk_size": 32,
        },
        "vision_config": {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2},
    },
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_describe_the_model_transformers_builds(name: str) -> None:
    check_against_transformers(VARIANTS[name])
