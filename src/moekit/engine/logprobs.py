"""Log-probabilities of tokens, from the logits the sampler draws from.

They are the model's own distribution, log_softmax of the raw fp32 logits, before temperature and
the top-k/top-p filters (vLLM's default, `raw_logprobs`): a client scoring text (lm-eval's
loglikelihood) wants the model's probabilities, not the sampler's. So for a greedy row the chosen
token's logprob is the top one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

MAX_TOP = 20  # vLLM's default max_logprobs; OpenAI allows 20 top_logprobs on chat


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob and the `top` most likely tokens at its position (id, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def chosen_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: Sequence[int]) -> list[TokenLogprob]:
    """logits [B, V], tokens[b] chosen at row b, top[b] how many alternatives row b wants → one each."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logprobs.gather(-1, torch.tensor(list(tokens), device=logits.device)[:, None])[:, 0].tolist()  # [B]
    widest = max(top, default=0)
    best_lp, best_ids = (logprobs.topk(widest, dim=-1) if widest else (None, None))  # [B, N] each
    out = []
    for b, token in enumerate(tokens):
        n = top[b]
        pairs = tuple(zip(best_ids[b, :n].tolist(), best_lp[b, :n].tolist())) if n else ()
        out.append(TokenLogprob(int(token), float(chosen[b]), pairs))
    return out


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], top: int) -> list[Optional[TokenLogprob]]:
    """logits [P, V] of a prompt's P positions → each prompt token's logprob given the ones before.

    The first token has no context, so its entry is None (as vLLM's prompt_logprobs and the
    legacy completions API's echo give it)."""
    if len(prompt) < 2:
        return [None] * len(prompt)
    entries = chosen_logprobs(logits[:-1], prompt[1:], [top] * (len(prompt) - 1))  # position i predicts i+1
    return [None, *entries]
