"""A Hub checkpoint plan as llama.cpp's converter would lay it out in a GGUF: names, types, metadata.

Read from llama.cpp's convert_hf_to_gguf.py (conversion/qwen.py, conversion/gpt_oss.py) of
llama-cpp-python 0.3.36 and src/models/{qwen3moe,openai-moe}.cpp, which say what the runtime loads:

  Hub (per layer)                          GGUF
  self_attn.{q,k,v,o}_proj.{weight,bias}   blk.N.attn_{q,k,v,output}.{weight,bias}
  self_attn.{q,k}_norm                     blk.N.attn_{q,k}_norm
  self_attn.sinks (gpt_oss)                blk.N.attn_sinks.weight (F32)
  input_layernorm                          blk.N.attn_norm
  post_attention_layernorm                 blk.N.ffn_norm (qwen3moe), blk.N.post_attention_norm (gpt-oss)
  mlp.gate / mlp.router                    blk.N.ffn_gate_inp.{weight,bias}
  experts, stacked [E, F, D] / [E, D, F]   blk.N.ffn_{gate,up,down}_exps.{weight,bias}; gpt-oss's
                                           interleaved gate_up split by even/odd rows

gpt-oss's MXFP4 experts become ggml MXFP4 blocks (one E8M0 byte, then 16 bytes of codes whose
nibble order the converter's `transform_nibble_layout` rewrites); everything 1-D is F32.

The vocabulary: a GGUF that llama.cpp loads needs tokenizer.ggml.* with as many tokens as the
embedding has rows and at least one BPE merge. `minimal_vocab` is a real byte-level BPE: the 256
byte tokens, the merge "Ġ Ġ", an end-of-text control token, and unused fillers up to vocab_size.
Text round-trips through it (one token per byte), so llama-server and moekit serve can be driven
with text; it is not the model family's tokenizer (no hub to fetch it from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moekit.bench.checkpoint_layout import TensorPlan

EOT = "<|endoftext|>"
MERGE = ("Ġ", "Ġ")


@dataclass(frozen=True)
class GGUFTensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order, in elements
    qtype: str  # ggml type name: F32, BF16, Q8_0, MXFP4
    make: Callable[[], "object"]  # → numpy array of the stored bytes (uint8) or F32 elements


ARCH = {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}


def gguf_name(model_type: str, hub: str) -> str:
    """The GGUF name of a non-expert Hub tensor."""
    if hub == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hub == "model.norm.weight":
        return "output_norm.weight"
    if hub == "lm_head.weight":
        return "output.weight"
    parts = hub.split(".")  # model.layers.N.<module...>.<weight|bias|sinks>
    layer, rest = parts[2], parts[3:]
    suffix = rest[-1] if rest[-1] in ("weight", "bias") else "weight"
    module = rest[-2] if rest[-1] in ("weight", "bias") else rest[-1]
    if module in _ATTN:
        base = _ATTN[module]
    elif module == "sinks":
        base = "attn_sinks"
    elif module in ("gate", "router"):
        base = "ffn_gate_inp"
    elif module == "input_layernorm":
        base = "attn_norm"
    elif module == "post_attention_layernorm":
        base = "post_attention_norm" if model_type == "gpt_oss" else "ffn_norm"
    else:
        raise ValueError(f"no GGUF name for {hub}")
    return f"blk.{layer}.{base}.{suffix}"


def metadata(config: dict) -> dict[str, object]:
    """The architecture's keys llama.cpp reads (llama-model.cpp, src/models/<arch>.cpp)."""
    model_type, arch = config["model_type"], ARCH[config["model_type"]]
    rope = config.get("rope_parameters") or {}
    experts = config.get("num_experts") or config.get("num_local_experts")
    ffn_expert = config.get("moe_intermediate_size") or config["intermediate_size"]
    keys: dict[str, object] = {
        "context_length": int(config.get("max_position_embeddings", 4096)),
        "embedding_length": config["hidden_size"],
        "block_count": config["num_hidden_layers"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.key_length": config["head_dim"],
        "attention.value_length": config["head_dim"],
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "rope.freq_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "expert_count": experts,
        "expert_used_count": config["num_experts_per_tok"],
        "expert_feed_forward_length": ffn_expert,
    }
    if model_type == "gpt_oss":
        keys["attention.sliding_window"] = config["sliding_window"]
        if rope.get("rope_type") == "yarn":
            keys["rope.scaling.type"] = "yarn"
            keys["rope.scaling.factor"] = float(rope["factor"])
            keys["rope.scaling.original_context_length"] = int(rope["original_max_position_embeddings"])
    return {f"{arch}.{k}": v for k, v in keys.items()}


def minimal_vocab(vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, ggml token types): the byte alphabet, 'ĠĠ', end-of-text, unused fillers to vocab_size."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet()) + ["".join(MERGE), EOT]
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(tokens)} tokens of the minimal vocabulary")
    types = [1] * (len(tokens) - 1) + [3]  # NORMAL bytes and merge, CONTROL end-of-text
    fillers = vocab_size - len(tokens)
    return tokens + [f"<unused_{i}>" for i in range(fillers)], types + [5] * fillers  # UNUSED


def hub_tokenizer(vocab_size: int):
    """The same vocabulary as a `tokenizers.Tokenizer` (tokenizer.json beside safetensors files)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, _ = minimal_vocab(vocab_size)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [MERGE]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT, special=True)])
    return tok


def transform_nibble_layout(blocks):
    """convert_hf_to_gguf's GptOssModel.transform_nibble_layout, on uint8 [..., 16] (torch)."""
    import torch

    t = ((blocks & 0x0F) << 4) | ((blocks & 0xF0) >> 4)
    a, b = t.chunk(2, dim=-1)
    a = torch.stack(((a & 0xF0).view(-1, 1), (a << 4).view(-1, 1)), dim=2).view(t.shape)
    b = torch.stack(((b >> 4).view(-1, 1), (b & 0x0F).view(-1, 1)), dim=2).view(t.shape)
    out = a | b
    return ((out & 0xF0) >> 4) | ((out & 0x0F) << 4)


def ggml_mxfp4(blocks, scales):
    """Hub MXFP4 (blocks [E, R, G, 16], scales [E, R, G]) → ggml MXFP4 bytes [E, R, G * 17] (numpy)."""
    import torch

    data = torch.cat((scales.unsqueeze(-1), transform_nibble_layout(blocks.contiguous())), dim=-1)
    return data.reshape(data.shape[0], data.shape[1], -1).numpy()


def expert_names(layer: int) -> dict[str, str]:
    return {p: f"blk.{layer}.ffn_{p}_exps" for p in ("gate", "up", "down")}


def is_matrix(t: TensorPlan) -> bool:
    return t.kind in ("matrix", "experts")
