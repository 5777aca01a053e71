"""Where each family keeps its tensors on the Hub, as transformers' save_pretrained writes them.

Layers live under `model.layers.{i}`: `input_layernorm`, `post_attention_layernorm`, `self_attn.*`
(q/k/v/o_proj, q_norm/k_norm, sinks; MLA's own names) and either a dense `mlp.{gate,up,down}_proj` or
an MoE block whose layout is this table's business:

  family        MoE block          router           routed experts
  mixtral,      block_sparse_moe   gate             experts.{j}.w1 / w3 / w2 (gate / up / down)
  phimoe
  qwen*, olmoe  mlp                gate             experts.{j}.gate_proj / up_proj / down_proj
  deepseek      mlp                gate (+ e_score_correction_bias)   as qwen
  granitemoe    block_sparse_moe   router.layer     input_linear [E, 2F, D], output_linear [E, D, F]
  gpt_oss       mlp                router (+ bias)  experts.gate_up_proj [E, D, 2F] gate/up INTERLEAVED,
                                                    down_proj [E, F, D] (x @ W), *_bias
  dbrx          ffn                router.layer     experts.mlp.w1 / v1 / w2, each [E*F, D] (w2: x @ W)
  llama4        feed_forward       router           experts.gate_up_proj [E, D, 2F] gate half then up
                                                    half, down_proj [E, F, D] (both x @ W); shared_expert

DBRX also names everything else its own way (transformer.wte, transformer.blocks.{i}.norm_attn_norm.*,
a fused Wqkv): the top-level fields below. llama4 calls its dense feed-forward `feed_forward` too, and
its multimodal checkpoints (model_type llama4) keep the text decoder under `language_model.`
beside a vision tower the text engine leaves unused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Optional


@dataclass(frozen=True)
class HubNames:
    # Where the decoder's pieces are: {prefix}.{embed}, {prefix}.{final_norm}, {prefix}.{layers}.{i}.
    prefix: str = "model"
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    layers: str = "layers"
    lm_head: str = "lm_head"  # the untied head's module (top level, not under prefix)
    input_norm: str = "input_layernorm"  # under a layer
    post_norm: str = "post_attention_layernorm"
    attention: str = "self_attn"
    fused_qkv: Optional[str] = None  # one tensor of q, k and v rows (DBRX's Wqkv) instead of q/k/v_proj
    o_proj: str = "o_proj"
    moe: str = "mlp"  # the MoE block, under model.layers.{i}
    router: str = "gate"  # under the MoE block; its .weight (and .bias where the router has one)
    selection_bias: str = "gate.e_score_correction_bias"
    # "per_expert": experts.{j}.<gate|up|down>.weight;  "stacked": one [E, ...] tensor each;
    # "stacked_interleaved": gpt_oss's transposed, interleaved tensors with biases;
    # "stacked_rows": DBRX's [E*F, D] gate, up and (transposed) down, named by expert_gate/up/down;
    # "stacked_transposed": llama4's [E, D, 2F] (gate half, up half) and [E, F, D], both x @ W.
    experts: Literal["per_expert", "stacked", "stacked_interleaved", "stacked_rows", "stacked_transposed"] = "per_expert"
    expert_gate: str = "gate_proj"
    expert_up: str = "up_proj"
    expert_down: str = "down_proj"
    stacked_gate_up: str = "experts.gate_up_proj"
    stacked_down: str = "experts.down_proj"
    shared: Optional[str] = None  # the shared expert(s) MLP under the MoE block
    shared_gate: str = "shared_expert_gate"
    dense_mlp: str = "mlp"  # a dense layer's feed-forward, under model.layers.{i}
    # Tensors of other modalities a text decoder rightly leaves unused (llama4's vision tower).
    unused_prefixes: tuple[str, ...] = ()


_LLAMA4 = HubNames(
    moe="feed_forward", dense_mlp="feed_forward", router="router", experts="stacked_transposed", shared="shared_expert"
)

FAMILIES: dict[str, HubNames] = {
    "mixtral": HubNames(moe="block_sparse_moe", expert_gate="w1", expert_up="w3", expert_down="w2"),
    "phimoe": HubNames(moe="block_sparse_moe", expert_gate="w1", expert_up="w3", expert_down="w2"),
    "qwen2_moe": HubNames(shared="shared_expert"),
    "qwen3_moe": HubNames(),
    "olmoe": HubNames(),
    "granitemoe": HubNames(
        moe="block_sparse_moe",
        router="router.layer",
        experts="stacked",
        stacked_gate_up="input_linear.weight",
        stacked_down="output_linear.weight",
    ),
    "gpt_oss": HubNames(router="router", experts="stacked_interleaved"),
    "dbrx": HubNames(
        prefix="transformer",
        embed="wte",
        final_norm="norm_f",
        layers="blocks",
        input_norm="norm_attn_norm.norm_1",
        post_norm="norm_attn_norm.norm_2",
        attention="norm_attn_norm.attn",
        fused_qkv="Wqkv",
        o_proj="out_proj",
        moe="ffn",
        router="router.layer",
        experts="stacked_rows",
        expert_gate="experts.mlp.w1",
        expert_up="experts.mlp.v1",
        expert_down="experts.mlp.w2",
    ),
    "llama4_text": _LLAMA4,
    "llama4": replace(
        _LLAMA4,
        prefix="language_model.model",
        lm_head="language_model.lm_head",
        unused_prefixes=("vision_model.", "multi_modal_projector."),
    ),
    "deepseek_v2": HubNames(shared="shared_experts"),
    "deepseek_v3": HubNames(shared="shared_experts"),
    "kimi_k2": HubNames(shared="shared_experts"),
}


def hub_names(model_type: str) -> HubNames:
    """The family's layout; dense families (llama, qwen3) and unknown ones use the common names."""
    return FAMILIES.get(model_type, HubNames())
