"""Which GGUF architectures moekit runs, and what llama.cpp's converter did to each (pure data).

A GGUF names its family by `general.architecture` (llama.cpp's name, not the Hub's `model_type`).
Each entry records what the GGUF itself does not say but llama.cpp's runtime assumes, read from
`convert_hf_to_gguf.py` (conversion/{qwen,llama,olmo}.py) and llama.cpp's src/models/*.cpp of
llama-cpp-python 0.3.36:

  arch       Hub model_type   MoE block         experts            q/k rows   renormalise top-K
  qwen3moe   qwen3_moe        mlp               gate/up/down_proj  as Hub     yes (norm_w = true)
  qwen2moe   qwen2_moe        mlp (+ shared)    gate/up/down_proj  as Hub     no
  llama      mixtral          block_sparse_moe  w1 / w3 / w2       PERMUTED   yes
  olmoe      olmoe            mlp               gate/up/down_proj  as Hub     no
  gpt-oss    gpt_oss          mlp (router)      MXFP4 gate/up/down as Hub     (softmax over the top-K)

gpt-oss (conversion/gpt_oss.py): the Hub's interleaved gate_up_proj is split into ffn_gate_exps
(even rows) and ffn_up_exps (odd rows), each re-packed as ggml MXFP4 blocks (the E8M0 byte first,
then the codes in ggml's nibble order); biases split alike; sinks become attn_sinks.weight and
post_attention_layernorm post_attention_norm. The reader gives the Hub's MXFP4 tensors back
(gguf_names, gguf_checkpoint), so the experts stay packed as the published safetensors' do.

"PERMUTED": LlamaModel.permute reorders each head's q and k rows from the Hub's half-split RoPE
layout to llama.cpp's interleaved one; the reader undoes it. The converter stacks each layer's
per-expert matrices into one [E, ...] tensor (blk.N.ffn_{gate,up,down}_exps); the reader splits it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GGUFFamily:
    arch: str  # general.architecture
    model_type: str  # the Hub config's model_type the adapters and the loader know
    moe: str  # the MoE block's Hub name under model.layers.{i}
    expert_names: tuple[str, str, str]  # Hub names of one expert's gate, up, down
    rope_permuted: bool  # q/k rows reordered by the converter (LlamaModel.permute)
    norm_topk_prob: bool  # what llama.cpp's build_moe_ffn does for this arch (norm_w)
    shared_expert: bool = False  # qwen2moe's sigmoid-gated shared expert


FAMILIES: dict[str, GGUFFamily] = {
    "qwen3moe": GGUFFamily("qwen3moe", "qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj"), False, True),
    "qwen2moe": GGUFFamily("qwen2moe", "qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj"), False, False,
                           shared_expert=True),
    "llama": GGUFFamily("llama", "mixtral", "block_sparse_moe", ("w1", "w3", "w2"), True, True),
    "olmoe": GGUFFamily("olmoe", "olmoe", "mlp", ("gate_proj", "up_proj", "down_proj"), False, False),
    "gpt-oss": GGUFFamily("gpt-oss", "gpt_oss", "mlp", ("gate_up_proj", "gate_up_proj", "down_proj"), False, False),
}

# How a refusal lists what is supported (llama only with experts: Mixtral).
SUPPORTED = "qwen3moe, qwen2moe, olmoe, gpt-oss, llama with experts (Mixtral)"

# Tensor types the reader dequantizes (gguf.quants does the arithmetic).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4")  # MXFP4: gpt-oss's experts, kept packed


def family_for(arch: Optional[str], expert_count: Optional[int]) -> Optional[GGUFFamily]:
    """The family of a GGUF, None when moekit does not run it (a dense llama is not Mixtral)."""
    family = FAMILIES.get(arch or "")
    if family is not None and family.arch == "llama" and not expert_count:
        return None
    return family
