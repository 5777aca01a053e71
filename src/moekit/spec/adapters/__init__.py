"""One adapter per Hugging Face `model_type`: config dict + name → ModelSpec.

The registry is plain data; `moekit.spec.loading` picks the adapter by `model_type`.
"""

from __future__ import annotations

from typing import Callable

from moekit.spec.adapters import dbrx, deepseek, gpt_oss, granitemoe, jamba, llama, llama4, mixtral, olmoe, phimoe, qwen
from moekit.spec.model_spec import ModelSpec

Adapter = Callable[[dict, str], ModelSpec]

ADAPTERS: dict[str, Adapter] = {
    "mixtral": mixtral.build,
    "qwen2_moe": qwen.build_qwen2_moe,
    "qwen3_moe": qwen.build_qwen3_moe,
    "olmoe": olmoe.build,
    "granitemoe": granitemoe.build,
    "gpt_oss": gpt_oss.build,
    "deepseek_v2": deepseek.build_v2,
    "deepseek_v3": deepseek.build_v3,
    "kimi_k2": deepseek.build_kimi_k2,
    "llama": llama.build_llama,
    "mistral": llama.build_mistral,
    "qwen2": qwen.build_qwen2,
    "qwen3": qwen.build_qwen3,
    "llama4": llama4.build,
    "llama4_text": llama4.build_text,
    "dbrx": dbrx.build,
    "phimoe": phimoe.build,
    "jamba": jamba.build,
}
