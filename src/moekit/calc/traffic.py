"""Bytes a decode step actually reads: the physical cost behind "active parameters".

One decode step for a batch of B sequences reads every always-resident weight once (the batch
shares it), one embedding row per token (not the table), the experts its tokens chose, and each
sequence's KV cache at the context.

Which experts does a batch read? Each token picks K distinct experts of E; under uniform routing
one token leaves a given expert unused with probability 1 − K/E, so B independent tokens leave
it unused with probability (1 − K/E)^B and the expected number of distinct experts read is
E · (1 − (1 − K/E)^B): K at B = 1, approaching E as B grows. Real routers are not uniform, so
real batches read somewhat fewer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moekit.calc.dtypes import DType, dense_dtype
from moekit.calc.kv_cache import KVCache
from moekit.spec.model_spec import ModelSpec, MoESpec

if TYPE_CHECKING:
    from moekit.calc.params import ParamCounts


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """E · (1 − (1 − K/E)^B): experts a batch of B tokens reads in one MoE layer."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class StepTraffic:
    batch: int
    dense_params: int  # always-resident weights read once per step; no embedding table
    embedding_row_params: int  # one row per token in the batch
    expert_params: float  # the expected union of chosen experts, over all MoE layers
    distinct_experts_per_layer: float  # mean over MoE layers (K at batch 1)
    weight_bytes: int
    kv_bytes: int  # every sequence reads its own cache
    total_bytes: int

    @property
    def params_read(self) -> float:
        return self.dense_params + self.embedding_row_params + self.expert_params


def dense_params_read(spec: ModelSpec, counts: ParamCounts) -> int:
    """Always-resident parameters minus the input embedding table. A tied head is the embedding
    table read in full, so it is added back when the counter books it under `embedding`."""
    b = counts.breakdown
    dense = counts.total_params - b.routed_experts_total - b.embedding
    if spec.tie_word_embeddings and b.head == 0:
        dense += spec.vocab_size * spec.hidden_size
    return dense


def step_traffic(
    spec: ModelSpec, counts: ParamCounts, dtype: DType, kv: KVCache, batch: int
) -> StepTraffic:
    moe = [layer.ffn for layer in spec.layers if isinstance(layer.ffn, MoESpec)]
    distinct = [expected_distinct_experts(m.num_experts, m.top_k, batch) for m in moe]
    expert_params = sum(d * m.expert.params() for d, m in zip(distinct, moe))
    dense = dense_params_read(spec, counts)
    rows = min(batch, spec.vocab_size) * spec.hidden_size
    weights = dense_dtype(dtype).bytes_for(dense + rows) + dtype.bytes_for(round(expert_params))
    kv_bytes = kv.bytes_per_sequence * batch
    return StepTraffic(
        batch=batch,
        dense_params=dense,
        embedding_row_params=rows,
        expert_params=expert_params,
        distinct_experts_per_layer=sum(distinct) / len(distinct) if distinct else 0.0,
        weight_bytes=weights,
        kv_bytes=kv_bytes,
        total_bytes=weights + kv_bytes,
    )
