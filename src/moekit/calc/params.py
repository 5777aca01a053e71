"""Exact parameter counts from a ModelSpec: total, active per token, and where they sit.

"Exact" means equal to `sum(p.numel() for p in model.parameters())` of the transformers CausalLM
built from the same config (tests check every family that way). Buffers are not parameters:
DeepSeek-V3's `e_score_correction_bias` is not counted, as transformers does not count it.

Three "active" conventions, because vendors publish all three (see DESIGN.md):

- `active_params`: everything one token touches; the input embedding table and the output head
  counted in full (Mistral, Qwen, Meta, Databricks).
- `active_params_excl_input_embedding`: without the input embedding (DeepSeek, OpenAI). With tied
  embeddings the one table is also the output head, which a token does use: it stays in.
- `active_params_non_embedding`: neither the input embedding nor the output head; with tied
  embeddings the one table is removed once.

A tied table is counted once everywhere (`breakdown.head` is 0). MTP modules and a vision tower
are reported in the breakdown and left out of every total.

No torch here: the calculator runs where only moekit is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.spec.layer_counts import layer_params  # the per-layer rule sits in spec (its adapters count with it)
from moekit.spec.model_spec import AttentionSpec, MambaSpec, ModelSpec


@dataclass(frozen=True)
class Breakdown:
    embedding: int
    attention: int
    router: int
    routed_experts_total: int
    routed_experts_active: int
    shared_experts: int
    dense_mlp: int
    norms: int
    head: int  # 0 when tied to the embedding (bar phimoe's lm_head bias)
    mamba: int  # mamba mixers (jamba), 0 elsewhere
    mtp: int  # reported apart, NOT in total_params
    vision: int  # reported apart, NOT in total_params


@dataclass(frozen=True)
class ParamCounts:
    total_params: int  # decoder only, as the text CausalLM counts it
    active_params: int  # everything a token touches, input embedding + head in full
    active_params_excl_input_embedding: int  # DeepSeek / OpenAI convention
    active_params_non_embedding: int  # neither embedding nor head
    active_fraction: float  # active_params / total_params
    breakdown: Breakdown


def count_params(spec: ModelSpec) -> ParamCounts:
    counts = [(layer, layer_params(layer)) for layer in spec.layers]
    embedding = spec.vocab_size * spec.hidden_size
    head = (0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size) + (
        spec.vocab_size if spec.lm_head_bias else 0
    )
    breakdown = Breakdown(
        embedding=embedding,
        attention=sum(c.mixer for layer, c in counts if isinstance(layer.mixer, AttentionSpec)),
        router=sum(c.router for _, c in counts),
        routed_experts_total=sum(c.expert_each * c.num_experts for _, c in counts),
        routed_experts_active=sum(c.expert_each * c.top_k for _, c in counts),
        shared_experts=sum(c.shared for _, c in counts),
        dense_mlp=sum(c.dense_mlp for _, c in counts),
        norms=sum(c.norms for _, c in counts) + spec.final_norm.params(spec.hidden_size),
        head=head,
        mamba=sum(c.mixer for layer, c in counts if isinstance(layer.mixer, MambaSpec)),
        mtp=spec.mtp_params,
        vision=spec.vision_params,
    )
    b = breakdown
    always_on = b.attention + b.mamba + b.router + b.shared_experts + b.dense_mlp + b.norms
    total = b.embedding + head + always_on + b.routed_experts_total
    active = b.embedding + head + always_on + b.routed_experts_active
    # A tied table is also the output head: excluding the input embedding keeps it (see module doc).
    excl_input = active - (0 if spec.tie_word_embeddings else b.embedding)
    non_embedding = active - b.embedding - head
    return ParamCounts(
        total_params=total,
        active_params=active,
        active_params_excl_input_embedding=excl_input,
        active_params_non_embedding=non_embedding,
        active_fraction=active / total,
        breakdown=breakdown,
    )
