"""GGUF metadata → the Hugging Face config dict that moekit's spec adapters take (pure functions).

Widths come from the tensors' own shapes where the metadata could disagree with them (an expert's
width is the expert tensor's), counts and hyper-parameters from `{arch}.*` keys. What the GGUF does
not record, llama.cpp's runtime hard-codes per architecture (gguf_families): the config says the
same, so moekit runs a GGUF as llama.cpp does.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from moekit.errors import CheckpointError
from moekit.weights.gguf_families import SUPPORTED, GGUFFamily, family_for

Shapes = Mapping[str, tuple[int, ...]]  # GGUF tensor name → torch-order shape


def _float32_decimal(value: float) -> float:
    """The decimal the converter wrote as float32 (1e-06, not 9.99999997e-07)."""
    import numpy as np

    return float(str(np.float32(value)))


def gguf_family(meta: Mapping[str, Any], where: str) -> GGUFFamily:
    arch = meta.get("general.architecture")
    family = family_for(arch, meta.get(f"{arch}.expert_count"))
    if family is None:
        what = f"{arch!r} without experts" if arch == "llama" else repr(arch)
        raise CheckpointError(f"{where}: GGUF architecture {what} is not supported (supported: {SUPPORTED})")
    return family


def _required(meta: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in meta:
        raise CheckpointError(f"{where}: GGUF metadata has no {key}")
    value = meta[key]
    if isinstance(value, list):
        raise CheckpointError(f"{where}: GGUF metadata {key} varies per layer ({value[:4]}...), which moekit does not run")
    return value


def _moe_layers(family: GGUFFamily, shapes: Shapes, num_layers: int, where: str) -> list[int]:
    """Layers without a router are dense; only the Qwen families have them."""
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
    if dense and family.model_type not in ("qwen2_moe", "qwen3_moe"):
        raise CheckpointError(f"{where}: layer {dense[0]} of this {family.arch} GGUF has no experts")
    return dense


def hf_config(meta: Mapping[str, Any], shapes: Shapes, where: str) -> dict:
    """The config.json the checkpoint this GGUF was converted from would have (for moekit's use)."""
    family = gguf_family(meta, where)
    arch = family.arch
    key = lambda name: _required(meta, f"{arch}.{name}", where)  # noqa: E731
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and not (arch == "gpt-oss" and scaling == "yarn"):
        raise CheckpointError(f"{where}: GGUF rope scaling {scaling!r} is not supported (only unscaled RoPE)")
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"{where}: GGUF has no token_embd.weight")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    num_layers = int(key("block_count"))
    gate = shapes.get("blk.0.ffn_gate_exps.weight") or shapes.get(f"blk.{num_layers - 1}.ffn_gate_exps.weight")
    if gate is None or len(gate) != 3:
        raise CheckpointError(f"{where}: GGUF has no 3-D expert tensors (blk.N.ffn_gate_exps.weight)")
    num_experts, expert_width = int(key("expert_count")), gate[1]
    dense = _moe_layers(family, shapes, num_layers, where)
    config: dict[str, Any] = {
        "model_type": family.model_type,
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _float32_decimal(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_decimal(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "hidden_act": "silu",
        "num_experts_per_tok": int(key("expert_used_count")),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", family.norm_topk_prob)),
        "bos_token_id": _opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _opt_int(meta.get("tokenizer.ggml.padding_token_id")),
    }
    if family.model_type == "gpt_oss":
        config.update(_gpt_oss(meta, shapes, num_experts, expert_width, where))
    elif family.model_type == "mixtral":
        # llama.cpp's llama graph attends to the whole context: no sliding window.
        config.update(num_local_experts=num_experts, intermediate_size=expert_width, sliding_window=None)
    elif family.model_type == "olmoe":
        config.update(num_experts=num_experts, intermediate_size=expert_width, clip_qkv=None)
    else:
        dense_width = shapes.get(f"blk.{dense[0]}.ffn_gate.weight", (0,))[0] if dense else None
        config.update(
            num_experts=num_experts,
            moe_intermediate_size=expert_width,
            intermediate_size=dense_width or int(meta.get(f"{arch}.feed_forward_length", expert_width)),
            decoder_sparse_step=1,
            mlp_only_layers=dense,
            use_sliding_window=False,
        )
        if family.model_type == "qwen3_moe":
            config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        else:
            shared = shapes.get("blk.0.ffn_gate_shexp.weight") or shapes.get(f"blk.{num_layers - 1}.ffn_gate_shexp.weight")
            config.update(qkv_bias="blk.0.attn_q.bias" in shapes, shared_expert_intermediate_size=shared[0] if shared else 0)
    return config


def _gpt_oss(meta: Mapping[str, Any], shapes: Shapes, num_experts: int, expert_width: int, where: str) -> dict:
    """What llama.cpp's openai-moe graph hard-codes: even layers slide (set_swa_pattern(2)), SwiGLU
    clamped at 7, biases everywhere; YaRN with gpt-oss's published betas when the GGUF says yarn."""
    key = lambda name: _required(meta, f"gpt-oss.{name}", where)  # noqa: E731
    layers = int(key("block_count"))
    config: dict[str, Any] = {
        "num_local_experts": num_experts,
        "intermediate_size": expert_width,
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "swiglu_limit": 7.0,
        "attention_bias": True,
    }
    theta = _float32_decimal(meta.get("gpt-oss.rope.freq_base", 10000.0))
    if meta.get("gpt-oss.rope.scaling.type") == "yarn":
        config["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": theta, "factor": _float32_decimal(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        }
    if shapes and any(name.endswith("_exps.weight") for name in shapes):
        config["quantization_config"] = {"quant_method": "mxfp4"}  # the reader refuses other expert types
    return config


def _opt_int(value: Optional[Any]) -> Optional[int]:
    return None if value is None else int(value)


def config_name(meta: Mapping[str, Any], fallback: str) -> str:
    name = meta.get("general.name")
    return name if isinstance(name, str) and name else fallback
