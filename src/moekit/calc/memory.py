"""What a model needs in memory at a dtype, context and batch: weights (always-resident vs routed
experts), KV cache, and a rough activation workspace.

Always-resident weights are everything a token may touch whatever the router says: embedding,
attention or mamba mixers, norms, routers, shared experts, dense MLPs, head. Routed-expert bytes
are the part an expert store may page in and out. MTP and vision weights are reported apart: a
text decoder serving tokens one at a time needs neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moekit.calc.dtypes import DType, dense_dtype
from moekit.calc.kv_cache import KVCache, cached_tokens, kv_cache
from moekit.spec.model_spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec

if TYPE_CHECKING:
    from moekit.calc.params import ParamCounts

FP32_BYTES = 4


@dataclass(frozen=True)
class WeightBytes:
    dtype: str
    resident: int
    routed_experts: int
    total: int
    mtp: int  # apart: not in `total`
    vision: int  # apart: not in `total`


@dataclass(frozen=True)
class MemoryPlan:
    weights: WeightBytes
    kv: KVCache
    activations: int
    total: int  # weights + KV cache + activations


def weight_bytes(counts: ParamCounts, dtype: DType) -> WeightBytes:
    routed = counts.breakdown.routed_experts_total
    resident = counts.total_params - routed
    dense = dense_dtype(dtype)
    return WeightBytes(
        dtype=dtype.name,
        resident=dense.bytes_for(resident),
        routed_experts=dtype.bytes_for(routed),
        total=dense.bytes_for(resident) + dtype.bytes_for(routed),
        mtp=dense.bytes_for(counts.breakdown.mtp),
        vision=dense.bytes_for(counts.breakdown.vision),
    )


def ffn_width_per_token(layer: LayerSpec) -> int:
    """Intermediate activations one token produces in a layer's feed-forward (gate and up
    outputs of every expert it runs, shared experts included)."""
    ffn = layer.ffn

    def out(mlp: MLPSpec, copies: int = 1) -> int:
        return copies * mlp.width * (2 if mlp.gated else 1)

    if isinstance(ffn, MLPSpec):
        return out(ffn)
    return out(ffn.expert, ffn.top_k) + (out(ffn.shared) if ffn.shared else 0)


def scores_per_token(layer: LayerSpec, context: int) -> int:
    mixer = layer.mixer
    if isinstance(mixer, AttentionSpec):
        return mixer.num_heads * cached_tokens(mixer, context)
    return 0


def activation_bytes(spec: ModelSpec, act_bytes: int, context: int, batch: int) -> int:
    """Decode workspace for one layer at a time (layers run one after another, so only the
    largest layer's live tensors count): per token in the batch, four hidden-size vectors
    (residual, normed input, mixer output, FFN output) and the widest FFN intermediate at the
    activation dtype, plus attention scores over the context and the vocabulary logits in fp32.
    A lower bound on what frameworks allocate; prefill of a long prompt needs more."""
    widest_ffn = max(ffn_width_per_token(layer) for layer in spec.layers)
    widest_scores = max(scores_per_token(layer, context) for layer in spec.layers)
    per_token = (4 * spec.hidden_size + widest_ffn) * act_bytes + (widest_scores + spec.vocab_size) * FP32_BYTES
    return batch * per_token


def activation_dtype_bytes(dtype: DType) -> int:
    """fp32 weights compute in fp32; everything else computes in a 16-bit float."""
    return 4 if dtype.name == "fp32" else 2


def memory_plan(
    spec: ModelSpec, counts: ParamCounts, dtype: DType, kv_dtype: DType, context: int, batch: int
) -> MemoryPlan:
    weights = weight_bytes(counts, dtype)
    kv = kv_cache(spec, kv_dtype, context, batch)
    activations = activation_bytes(spec, activation_dtype_bytes(dtype), context, batch)
    return MemoryPlan(
        weights=weights, kv=kv, activations=activations, total=weights.total + kv.total_bytes + activations
    )
