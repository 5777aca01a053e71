"""llama.cpp tensor names → the Hub names moekit's loader asks for (pure functions).

llama.cpp's converter renamed every tensor (gguf-py's TensorNameMap), stacked each layer's experts
into one [E, ...] tensor and, for Mixtral, permuted q/k rows. `hub_sources` inverts that: each Hub
name the original checkpoint had → where its data is in the GGUF (a tensor, an expert index into a
stacked one, and the head count of a row permutation to undo).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

from moekit.errors import CheckpointError
from moekit.weights.gguf_families import GGUFFamily

TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
# Per layer, the same for every supported family (suffix after blk.N.).
LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",  # a dense layer's MLP
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
SHARED = {  # qwen2moe's shared expert and its sigmoid gate
    "ffn_gate_inp_shexp": "shared_expert_gate",
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
}
STACKED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # in the order of expert_names
# Written by some converters, used by no supported family's graph: llama.cpp recomputes them.
IGNORED = ("rope_freqs.weight",)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class Source:
    tensor: str  # GGUF tensor name
    expert: Optional[int] = None  # index into a stacked [E, ...] expert tensor
    unpermute_heads: Optional[int] = None  # undo LlamaModel.permute with this many heads
    interleave: Optional[str] = None  # gpt-oss: rows of `tensor` (gate) alternate with this one's (up)
    mxfp4: Optional[str] = None  # gpt-oss: "blocks" or "scales" of the Hub's MXFP4 form of `tensor`


# gpt-oss: the names its converter gives the Hub's (conversion/gpt_oss.py), per layer.
GPT_OSS = {"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm",
           "ffn_gate_inp": "mlp.router"}


def _gpt_oss_experts(layer: str, part: str, kind: str, qtype: str, where: str) -> dict[str, Source]:
    """The Hub's expert tensors that blk.N.<part>.<kind> holds (up's are its gate's pair)."""
    if part == "ffn_up_exps":
        return {}
    pre, name = f"model.layers.{layer}.mlp.experts.", f"blk.{layer}.{part}.{kind}"
    pair = f"blk.{layer}.ffn_up_exps.{kind}" if part == "ffn_gate_exps" else None
    hub = "gate_up_proj" if pair else "down_proj"
    if kind == "bias":
        return {f"{pre}{hub}_bias": Source(name, interleave=pair)}
    if qtype != "MXFP4":
        raise CheckpointError(f"{where}: GGUF tensor {name} is {qtype}: moekit reads gpt-oss GGUFs whose experts are MXFP4")
    return {f"{pre}{hub}_{piece}": Source(name, interleave=pair, mxfp4=piece) for piece in ("blocks", "scales")}


def _layer_name(family: GGUFFamily, part: str) -> Optional[str]:
    if part in LAYER:
        return LAYER[part]
    if part == "ffn_gate_inp":
        return f"{family.moe}.gate"
    if family.shared_expert and part in SHARED:
        return f"{family.moe}.{SHARED[part]}"
    return None


def hub_sources(family: GGUFFamily, tensors: Iterable[tuple[str, tuple[int, ...]]], heads: int, kv_heads: int,
                where: str, qtypes: Optional[dict[str, str]] = None) -> dict[str, Source]:
    """Hub name → Source for every tensor of the GGUF; an unknown tensor is refused by name.
    qtypes: GGUF tensor → its type (gpt-oss's experts are read only as MXFP4)."""
    out: dict[str, Source] = {}
    qtypes = qtypes or {}
    for name, shape in tensors:
        if name in TOP:
            out[TOP[name]] = Source(name)
            continue
        if name in IGNORED:
            continue
        match = _BLOCK.match(name)
        part = match and match.group(2)
        if match and family.arch == "gpt-oss" and part in STACKED:
            out.update(_gpt_oss_experts(match.group(1), part, match.group(3), qtypes.get(name, ""), where))
            continue
        if match and family.arch == "gpt-oss" and part in GPT_OSS:
            suffix = "" if part == "attn_sinks" else f".{match.group(3)}"
            out[f"model.layers.{match.group(1)}.{GPT_OSS[part]}{suffix}"] = Source(name)
            continue
        if match and part in STACKED:
            layer, kind = match.group(1), family.expert_names[STACKED.index(part)]
            for j in range(shape[0]):
                out[f"model.layers.{layer}.{family.moe}.experts.{j}.{kind}.{match.group(3)}"] = Source(name, expert=j)
            continue
        hub = match and _layer_name(family, part)
        if not hub:
            raise CheckpointError(f"{where}: GGUF tensor {name} has no place in a {family.arch} model")
        heads_of = {"attn_q": heads, "attn_k": kv_heads}.get(part) if family.rope_permuted else None
        out[f"model.layers.{match.group(1)}.{hub}.{match.group(3)}"] = Source(name, unpermute_heads=heads_of)
    return out
