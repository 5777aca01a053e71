"""How the next token is chosen from logits: greedy, temperature, top-k, top-p, seeded.

Pure functions over a [B, V] float32 logits tensor. The order of the filters follows
transformers' sampling warpers (temperature, then top-k, then top-p), so a user who knows its
`generate` gets the same distribution from the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from moekit.errors import MoekitError
from moekit import ops


# What torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing fp32 logits by 1e-308 gives
# inf - inf = NaN probabilities, and any temperature this small picks the argmax anyway.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) means greedy: argmax, no randomness
    top_k: Optional[int] = None  # None or 0: no top-k filter
    top_p: Optional[float] = None  # None or 1.0: no nucleus filter
    seed: Optional[int] = None  # None: a fresh, unrepeatable stream

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def check_sampling(params: SamplingParams) -> None:
    if params.temperature < 0:
        raise MoekitError(f"temperature must be >= 0 (0 is greedy), got {params.temperature}")
    if params.top_k is not None and params.top_k < 0:
        raise MoekitError(f"top-k must be >= 1 (or 0 for none), got {params.top_k}")
    if params.top_p is not None and not 0.0 < params.top_p <= 1.0:
        raise MoekitError(f"top-p must be in (0, 1], got {params.top_p}")
    if params.seed is not None and not SEED_MIN <= params.seed <= SEED_MAX:
        raise MoekitError(f"seed must be between {SEED_MIN} and {SEED_MAX} (a 64-bit seed), got {params.seed}")


def make_generator(params: SamplingParams, device: torch.device | str) -> Optional[torch.Generator]:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def greedy(logits: Tensor) -> Tensor:
    """[B, V] -> [B] int64; ties go to the lowest id, as torch.argmax (and transformers) does
    (moekit.ops.rows_argmax: torch.argmax's indices, faster where the operators are built)."""
    return ops.rows_argmax(logits)


def filter_top_k(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits per row, -inf elsewhere."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p (at least one)."""
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Ascending order: drop the low tail whose mass stays within 1 - p; the top token always survives.
    drop_sorted = cumulative <= (1.0 - p)
    drop_sorted[..., -1] = False
    drop = drop_sorted.scatter(-1, sorted_ids, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a non-greedy step draws from: [B, V] float32 rows summing to 1."""
    scaled = logits.float() / params.temperature
    if params.top_k:
        scaled = filter_top_k(scaled, params.top_k)
    if params.top_p is not None and params.top_p < 1.0:
        scaled = filter_top_p(scaled, params.top_p)
    return scaled.softmax(dim=-1)


def next_tokens(logits: Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> Tensor:
    """[B, V] logits -> [B] int64 token ids."""
    if params.greedy:
        return greedy(logits)
    probs = sampling_probs(logits, params)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
