"""transformers' own greedy `generate`: the baseline of `moekit bench decode --vs transformers`.

transformers is a test/bench dependency, never a runtime one: imported inside `load_transformers`.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from moekit.errors import MoekitError


def load_transformers(folder, dtype: str, device: str):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise MoekitError("--vs transformers needs the transformers package: pip install transformers") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    # Exactly N tokens, like moekit with no stop ids (min_new_tokens would forbid eos instead,
    # and the two sides would then generate different text).
    model.generation_config.eos_token_id = None
    return model.to(device).eval()


def _hf_generate(model, ids: torch.Tensor, new: int) -> tuple[float, torch.Tensor]:
    """(wall seconds, output ids) of one greedy transformers generate call."""
    device = ids.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, pad_token_id=0
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def transformers_timer(model, prompts: torch.Tensor, new_tokens: int) -> Callable[[], float]:
    """One call = generate N and generate 1; N - 1 decode steps are the difference."""
    ids = prompts.to(next(model.parameters()).device)

    def once() -> float:
        full, _ = _hf_generate(model, ids, new_tokens)
        first, _ = _hf_generate(model, ids, 1)
        return prompts.shape[0] * (new_tokens - 1) / max(full - first, 1e-9)

    return once


def transformers_tokens(model, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    ids = prompts.to(next(model.parameters()).device)
    return _hf_generate(model, ids, new_tokens)[1][:, prompts.shape[1] :].tolist()


class TransformersBaseline:
    """`--vs transformers`: the same checkpoint, dtype and device in this process, any batch."""

    name = "transformers"

    def __init__(self, folder, dtype: str, device: str):
        self.model = load_transformers(folder, dtype, device)

    def supports(self, batch: int) -> bool:
        return True

    def timer(self, prompts: torch.Tensor, new_tokens: int) -> Callable[[], float]:
        return transformers_timer(self.model, prompts, new_tokens)

    def tokens(self, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
        return transformers_tokens(self.model, prompts, new_tokens)

    def info(self) -> dict:
        import transformers

        return {"transformers": transformers.__version__}
