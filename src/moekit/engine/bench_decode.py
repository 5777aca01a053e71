"""Decode speed measured in one run: moekit against transformers' `generate`, same checkpoint, dtype, prompts.

Both sides see the same B prompts of the same length (no padding) and must produce exactly N new
tokens (no early stop). Decode tokens/s counts B x (N - 1) tokens over the decode steps:
- moekit times its decode loop directly (the prefill is timed apart);
- transformers' `generate` is timed whole for N and for 1 new token; the difference is N - 1
  decode steps (its per-call set-up cancels out).
Each side gets warm-up calls, then the median of `repeats` timed calls, the two sides taking turns. The roofline divides the
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


def _interleaved_medians(sides: list[Callable[[], float]], repeats: int, warmup: int) -> list[float]:
    """Median of each side's timed calls, the sides taking turns so that a noisy neighbour on the
    machine slows both alike rather than whichever side happened to run during it."""
    for _ in range(warmup):
        for side in sides:
            side()
    runs: list[list[float]] = [[] for _ in sides]
    for _ in range(repeats):
        for side, out in zip(sides, runs):
            out.append(side())
    return [statistics.median(r) for r in runs]


def moekit_timer(engine: Engine, prompts: torch.Tensor, settings: BenchSettings) -> Callable[[], float]:
    """One call = one generate; returns its decode tok/s (the prefill is timed apart by generate)."""
    rows = prompts.tolist()

    def once() -> float:
        gen = engine.generate(rows, max_new_tokens=settings.tokens, stop_ids=(), record_routing=False)
        return gen.timing.decode_tok_s

    return once


def moekit_metered(engine: Engine, prompts: torch.Tensor, settings: BenchSettings) -> tuple[float, list[list[int]]]:
    """(mean params one decode step reads, greedy tokens) from one metered run."""
    gen = engine.generate(prompts.tolist(), max_new_tokens=settings.tokens, stop_ids=())
    return statistics.fmean(decode_step_params(engine.spec, gen)), gen.token_ids


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


def transformers_timer(model, prompts: torch.Tensor, settings: BenchSettings) -> Callable[[], float]:
    """One call = generate N and generate 1; N - 1 decode steps are the difference."""
    ids = prompts.to(next(model.parameters()).device)

    def once() -> float:
        full, _ = _hf_generate(model, ids, settings.tokens)
        first, _ = _hf_generate(model, ids, 1)
        return prompts.shape[0] * (settings.tokens - 1) / max(full - first, 1e-9)

    return once


def transformers_tokens(model, prompts: torch.Tensor, settings: BenchSettings) -> list[list[int]]:
    ids = prompts.to(next(model.parameters()).device)
    return _hf_generate(model, ids, settings.tokens)[1][:, prompts.shape[1] :].tolist()


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
        sides = [moekit_timer(engine, prompts, settings)]
        if hf is not None:
            sides.append(transformers_timer(hf, prompts, settings))
        medians = _interleaved_medians(sides, settings.repeats, settings.warmup)
        params_step, our_tokens = moekit_metered(engine, prompts, settings)
        theirs = medians[1] if hf is not None else None
        same = transformers_tokens(hf, prompts, settings) == our_tokens if hf is not None else None
        step_bytes = params_step * engine.bytes_per_param
        roof = batch * bandwidth_bytes_s / step_bytes if bandwidth_bytes_s else None
        results.append(BatchResult(batch, medians[0], theirs, step_bytes, roof, same))
    return results
