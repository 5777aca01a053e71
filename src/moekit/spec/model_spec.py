"""What a decoder IS: one normalised description shared by the calculator and the engine.

An adapter per Hugging Face `model_type` (see `adapters.py`) turns a `config.json` into a
`ModelSpec`. The calculator counts parameters and bytes from it; the engine builds its modules
from it. Nothing here imports torch.

Shape legend used across moekit: T tokens, D hidden, E routed experts, K experts per token,
F expert width, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

NormKind = Literal["rms", "layer"]
Activation = Literal["silu", "gelu", "gelu_tanh", "swiglu_oai"]


@dataclass(frozen=True)
class NormSpec:
    kind: NormKind = "rms"
    eps: float = 1e-6
    bias: bool = False  # LayerNorm with a bias (phimoe); DBRX's LayerNorm has none

    def params(self, width: int) -> int:
        return width * (2 if self.bias else 1)


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    # The Hub's `rope_scaling` / `rope_parameters` dict, normalised: {"rope_type": "yarn", "factor": ..}
    # None means plain RoPE. Kept as a tuple of pairs so the spec stays hashable.
    scaling: Optional[tuple[tuple[str, object], ...]] = None
    partial_rotary_factor: float = 1.0
    # llama4 rotates pairs (x0, x1), (x2, x3) as complex numbers, not halves: the engine loads q/k
    # rows of each head reordered so the halves form runs them (same dot products).
    interleaved: bool = False
    # llama4 rotates in fp32 and casts back; the llama-style families rotate in the model dtype.
    fp32: bool = False

    def scaling_dict(self) -> dict:
        return dict(self.scaling) if self.scaling else {}


@dataclass(frozen=True)
class AttentionSpec:
    """Multi-head / grouped-query attention (`kind="mha"`) or DeepSeek's latent attention (`"mla"`)."""

    kind: Literal["mha", "mla"]
    hidden_size: int  # D
    num_heads: int
    num_kv_heads: int
    head_dim: int  # for MLA: qk_nope_head_dim + qk_rope_head_dim
    qkv_bias: bool = False
    o_bias: bool = False
    # "head": one RMSNorm of head_dim shared by all heads (qwen3, llama4 uses a weightless L2 norm);
    # "full": RMSNorm over the whole q / k projection (olmoe); None: no q/k norm.
    qk_norm: Optional[Literal["head", "full", "l2"]] = None
    sinks: bool = False  # gpt_oss: one learned logit per head that absorbs attention mass
    sliding_window: Optional[int] = None  # None = full attention for this layer
    # Latent attention (MLA) only.
    q_lora_rank: Optional[int] = None  # None = q projected directly (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # granitemoe's attention_multiplier replaces 1/sqrt(head_dim); None = the usual scale.
    softmax_scale: Optional[float] = None
    chunk_size: Optional[int] = None  # llama4 chunked local attention
    use_rope: bool = True  # False: no positional rotation in this layer (llama4 NoPE layers, jamba)
    # llama4's temperature tuning on NoPE layers, (floor_scale, attn_scale): queries at position p are
    # scaled by 1 + attn_scale·log1p(floor((p + 1) / floor_scale)). None: no tuning.
    query_temperature: Optional[tuple[float, float]] = None


@dataclass(frozen=True)
class MambaSpec:
    """A Mamba (selective SSM) mixer in place of attention (jamba)."""

    hidden_size: int
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool = True
    proj_bias: bool = False
    inner_norms: bool = True  # jamba's dt/B/C RMSNorms


@dataclass(frozen=True)
class MLPSpec:
    """A feed-forward block: gated (gate, up, down) or plain (up, down)."""

    hidden_size: int  # D
    width: int  # F
    gated: bool = True
    bias: bool = False
    activation: Activation = "silu"

    def params(self) -> int:
        mats = 3 if self.gated else 2
        p = mats * self.hidden_size * self.width
        if self.bias:
            p += (2 if self.gated else 1) * self.width + self.hidden_size
        return p


@dataclass(frozen=True)
class RouterSpec:
    """How a family chooses experts: data, not code. The engine's router reads these fields."""

    num_experts: int  # E
    top_k: int  # K
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    # "score_then_topk": scores over all E, then top-K (mixtral, qwen, olmoe, deepseek).
    # "topk_then_score": top-K on raw logits, then softmax over the K (gpt_oss, granitemoe).
    # "sparsemixer": phimoe's top-2, each expert weighed by a softmax over the logits near it.
    order: Literal["score_then_topk", "topk_then_score", "sparsemixer"] = "score_then_topk"
    jitter_eps: float = 0.0  # sparsemixer's router_jitter_noise: how near a logit counts
    normalize: bool = True  # divide the K weights by their sum
    norm_p: Optional[float] = None  # DBRX: divide by their p-norm (torch.norm) instead of the sum
    scaling: float = 1.0  # routed_scaling_factor
    bias: bool = False  # the router Linear has a bias (gpt_oss)
    selection_bias: bool = False  # e_score_correction_bias: added for choosing only (deepseek_v3)
    n_group: int = 1
    topk_group: int = 1
    # How a group is scored before keeping `topk_group` of `n_group`: DeepSeek-V3 sums each group's
    # top-2 (biased) scores; DeepSeek-V2's group_limited_greedy takes the group's max score.
    group_scoring: Literal["top2_sum", "max"] = "top2_sum"
    fp32: bool = True  # gate weight kept in fp32 and its GEMM run there (DeepSeek); adapters set False elsewhere


@dataclass(frozen=True)
class MoESpec:
    router: RouterSpec
    expert: MLPSpec  # one routed expert
    shared: Optional[MLPSpec] = None  # all shared experts fused into one MLP of their total width
    num_shared: int = 0  # how many shared experts `shared` stands for (for reporting)
    shared_gate: bool = False  # qwen2_moe: shared output × sigmoid(Linear(D, 1))
    # llama4: the routing weight scales each chosen expert's INPUT (expert(w·x), not w·expert(x)).
    weigh_input: bool = False

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k


Mixer = Union[AttentionSpec, MambaSpec]
FeedForward = Union[MLPSpec, MoESpec]


@dataclass(frozen=True)
class LayerSpec:
    mixer: Mixer
    ffn: FeedForward
    norm: NormSpec = NormSpec()
    # Norms per layer beyond the two pre-norms (olmo-style post norms, gemma-style sandwiches).
    extra_norms: int = 0

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoESpec)


@dataclass(frozen=True)
class Multipliers:
    """granitemoe's scalars; 1.0 everywhere means none."""

    embedding: float = 1.0
    residual: float = 1.0
    logits_scaling: float = 1.0  # logits are DIVIDED by this


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    name: str
    vocab_size: int
    hidden_size: int  # D
    layers: tuple[LayerSpec, ...]
    tie_word_embeddings: bool = False
    final_norm: NormSpec = NormSpec()
    rope: RopeSpec = RopeSpec()
    max_position_embeddings: int = 4096
    multipliers: Multipliers = Multipliers()
    # Counted apart from the decoder, never in the active share of a text token.
    mtp_params: int = 0  # DeepSeek-V3 multi-token-prediction layers
    vision_params: int = 0  # llama4's vision tower and projector
    # Anything the engine needs that no other family has, e.g. ("swiglu_limit", 7.0).
    extras: tuple[tuple[str, object], ...] = field(default=())
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    lm_head_bias: bool = False  # phimoe's lm_head_bias: V extra parameters, even when tied

    @property
    def num_layers(self) -> int:  # L
        return len(self.layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.is_moe)

    def extra(self, key: str, default: object = None) -> object:
        return dict(self.extras).get(key, default)
