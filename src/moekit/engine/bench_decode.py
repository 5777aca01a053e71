"""Decode speed measured in one run: moekit against transformers' `generate`, same checkpoint, dtype, prompts.

Both sides see the same B prompts of the same length (no padding) and must produce exactly N new
tokens (no early stop). Decode tokens/s counts B x (N - 1) tokens over the decode steps:
- moekit times its decode loop directly (the prefill is timed apart);
- transformers' `generate` is timed whole for N and for 1 new token; the difference is N - 1
  decode steps (its per-call set-up cancels out).
Each side gets warm-up calls, then the median of `repeats` timed calls. The roofline divides the
machine's memory bandwidth by the bytes one decode step reads (from the meter: shared weights
once, one embedding row per row, the union of the experts the batch chose), KV cache excluded.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from moekit.engine.loader import Engine
from moekit.engine.meter import decode_step_params
from moekit.errors import MoekitError


@dataclass(frozen=True)
class BenchSettings:
    batches: tuple[int, ...] = (1, 8)
    tokens: int = 32  # N new tokens per row
    prompt_len: int = 16
    repeats: int = 3
    warmup: int = 1
    seed: int = 0


@dataclass(frozen=True)
class BatchResult:
    batch: int
    moekit_tok_s: float
    transformers_tok_s: Optional[float]
    bytes_per_step: float  # mean over decode steps, at the engine dtype
    roofline_tok_s: Optional[float]  # B x bandwidth / bytes_per_step
    same_tokens: Optional[bool]  # greedy outputs identical on both sides

    @property
    def ratio(self) -> Optional[float]:
        if not self.transformers_tok_s:
            return None
        return self.moekit_tok_s / self.transformers_tok_s

    @property
    def roofline_share(self) -> Optional[float]:
        if not self.roofline_tok_s:
            return None
        return self.moekit_tok_s / self.roofline_tok_s

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "roofline_share": self.roofline_share}


def bench_prompts(vocab_size: int, batch: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=gen)  # [B, P]


def _median(fn: Callable[[], float], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeats))


def moekit_decode(engine: Engine, prompts: torch.Tensor, settings: BenchSettings) -> tuple[float, float, list[list[int]]]:
    """(median decode tok/s, mean params per decode step, greedy tokens)."""
    rows = prompts.tolist()

    def once() -> float:
        gen = engine.generate(rows, max_new_tokens=settings.tokens, stop_ids=(), record_routing=False)
        return gen.timing.decode_tok_s

    tok_s = _median(once, settings.repeats, settings.warmup)
    metered = engine.generate(rows, max_new_tokens=settings.tokens, stop_ids=())
    per_step = decode_step_params(engine.spec, metered)
    return tok_s, statistics.fmean(per_step), metered.token_ids


def load_transformers(folder, dtype: str, device: str):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise MoekitError("--vs transformers needs the transformers package: pip install transformers") from None
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
    return model.to(device).eval()


def transformers_decode(model, prompts: torch.Tensor, settings: BenchSettings) -> tuple[float, list[list[int]]]:
    """(median decode tok/s, greedy tokens) of transformers' own generate."""
    device = next(model.parameters()).device
    ids = prompts.to(device)
    mask = torch.ones_like(ids)

    def call(new: int) -> tuple[float, torch.Tensor]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=0,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, out

    def once() -> float:
        full, _ = call(settings.tokens)
        first, _ = call(1)
        return prompts.shape[0] * (settings.tokens - 1) / max(full - first, 1e-9)

    tok_s = _median(once, settings.repeats, settings.warmup)
    _, out = call(settings.tokens)
    return tok_s, out[:, prompts.shape[1] :].tolist()


def bench_decode(
    engine: Engine,
    settings: BenchSettings,
    vs_transformers: bool,
    bandwidth_bytes_s: Optional[float],
) -> list[BatchResult]:
    if settings.tokens < 2:
        raise MoekitError("--tokens must be at least 2 (one prefill token, then decode steps)")
    if settings.repeats < 1:
        raise MoekitError("--repeats must be at least 1")
    if any(b < 1 for b in settings.batches):
        raise MoekitError("--batch sizes must be at least 1")
    if settings.prompt_len + settings.tokens > engine.spec.max_position_embeddings:
        raise MoekitError("prompt length + tokens exceeds the model's context")
    hf = load_transformers(engine.folder, engine.dtype, engine.device) if vs_transformers else None
    results = []
    for batch in settings.batches:
        prompts = bench_prompts(engine.spec.vocab_size, batch, settings.prompt_len, settings.seed + batch)
        ours, params_step, our_tokens = moekit_decode(engine, prompts, settings)
        theirs, same = None, None
        if hf is not None:
            theirs, their_tokens = transformers_decode(hf, prompts, settings)
            same = our_tokens == their_tokens
        step_bytes = params_step * engine.bytes_per_param
        roof = batch * bandwidth_bytes_s / step_bytes if bandwidth_bytes_s else None
        results.append(BatchResult(batch, ours, theirs, step_bytes, roof, same))
    return results
