"""Tiny random checkpoints of every MHA family, written by transformers' save_pretrained.

Every parameter is re-drawn (norm weights around 1, biases and sinks non-zero, routers wide enough
that top-K is not decided by rounding), so a mistake in any piece moves the logits far beyond the
1e-4 the tests allow. Each case is a (family, seed, config overrides) triple.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from moekit.model.decoder import Decoder
from moekit.spec import load_spec
from moekit.weights.checkpoint import open_checkpoint

VOCAB = 128
PROMPT_LEN = 20

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@dataclass(frozen=True)
class Case:
    id: str
    family: str
    seed: int
    overrides: dict = field(default_factory=dict)


CASES = [
    Case("mixtral-a", "mixtral", 0, dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                         num_experts_per_tok=2)),
    Case("mixtral-b", "mixtral", 1, dict(hidden_size=64, intermediate_size=24, num_hidden_layers=3, num_local_experts=8,
                                         num_experts_per_tok=3, num_key_value_heads=1, tie_word_embeddings=True)),
    Case("mixtral-window", "mixtral", 2, dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                              num_experts_per_tok=2, sliding_window=5)),
    Case("qwen2_moe-dense-layer", "qwen2_moe", 0, dict(
        intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_hidden_layers=3,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])),
    Case("qwen2_moe-sparse-step", "qwen2_moe", 1, dict(
        intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_hidden_layers=2,
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2)),
    Case("qwen2_moe-window", "qwen2_moe", 2, dict(
        intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_hidden_layers=3,
        num_experts=8, num_experts_per_tok=2, use_sliding_window=True, sliding_window=5, max_window_layers=2)),
    Case("qwen3_moe-a", "qwen3_moe", 0, dict(
        intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, head_dim=16)),
    Case("qwen3_moe-b", "qwen3_moe", 1, dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, num_attention_heads=8, num_key_value_heads=4, head_dim=8)),
    Case("olmoe-a", "olmoe", 0, dict(intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)),
    Case("olmoe-b", "olmoe", 1, dict(intermediate_size=24, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                     norm_topk_prob=True, clip_qkv=2.0, num_key_value_heads=4)),
    Case("granitemoe-multipliers", "granitemoe", 0, dict(
        intermediate_size=32, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=2,
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0)),
    Case("granitemoe-tied", "granitemoe", 1, dict(
        intermediate_size=24, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=6.0,
        tie_word_embeddings=True)),
    Case("gpt_oss-window", "gpt_oss", 0, dict(
        intermediate_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, head_dim=12,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    Case("gpt_oss-yarn", "gpt_oss", 1, dict(
        intermediate_size=24, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
        sliding_window=8, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})),
    Case("llama-a", "llama", 0, dict(intermediate_size=64, num_hidden_layers=2)),
    Case("llama-llama3-rope", "llama", 1, dict(
        intermediate_size=48, num_hidden_layers=2, attention_bias=True, mlp_bias=True, head_dim=16,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    Case("mistral-window", "mistral", 3, dict(intermediate_size=40, num_hidden_layers=2, sliding_window=6)),
    Case("qwen2-bias", "qwen2", 3, dict(intermediate_size=40, num_hidden_layers=2)),
    Case("qwen3-a", "qwen3", 0, dict(intermediate_size=64, num_hidden_layers=2, head_dim=16)),
    Case("qwen3-b", "qwen3", 1, dict(intermediate_size=40, num_hidden_layers=3, head_dim=8, num_attention_heads=6,
                                     num_key_value_heads=3, tie_word_embeddings=True)),
]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter so each one matters at the scale of the test's tolerance."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "router" in name or name.endswith(".gate.weight") or "gate.layer" in name:
                p.copy_(noise)  # wide router logits: top-K is never a near tie
            elif "sinks" in name:
                p.copy_(noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)  # biases
            else:
                p.copy_(noise * (0.6 / p.shape[-1] ** 0.5))


def write_checkpoint(case: Case, folder: Path):
    """Save the case's transformers model under `folder` and return it (eval, fp32, eager attention)."""
    import transformers

    kwargs = {**BASE, **case.overrides}
    config = transformers.AutoConfig.for_model(case.family, **kwargs)
    torch.manual_seed(case.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize(model, case.seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder)
    return model


def load_ours(folder: Path, dtype=torch.float32) -> Decoder:
    decoder = Decoder(load_spec(folder), dtype=dtype)
    decoder.load_checkpoint(open_checkpoint(folder))
    return decoder


def prompt(seed: int, length: int = PROMPT_LEN) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(3, VOCAB, (1, length), generator=gen)


def full_logits(decoder: Decoder, ids: torch.Tensor) -> torch.Tensor:
    """One forward over the whole prompt [B, T] (no padding) → [B, T, V]."""
    b, t = ids.shape
    cache = decoder.new_cache(b, t)
    positions = torch.arange(t).expand(b, t)
    return decoder(ids, cache, positions)


def left_padded(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-D prompts → ids [B, T] left-padded, key_mask [B, T], positions [B, T] (pads at position 0)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = True
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions
