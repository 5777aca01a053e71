"""Decode speed measured in one run: moekit against a named baseline, same checkpoint, precision, prompts.

Both sides see the same B prompts of the same length (no padding) and must produce exactly N new
tokens (no early stop). Decode tokens/s counts B x (N - 1) tokens over the decode steps:
- moekit times its decode loop directly (the prefill is timed apart);
- transformers' `generate` is timed whole for N and for 1 new token; the difference is N - 1
  decode steps (its per-call set-up cancels out);
- llama.cpp (llama-cpp-python, in a child process; B sequences of one context, one llama_decode of
  B tokens a step) times its own decode loop.
Each side gets warm-up calls, then the median of `repeats` timed calls, the two sides taking turns. The roofline divides the
machine's memory bandwidth by the bytes one decode step reads (from the meter: shared weights
once, one embedding row per row, the union of the experts the batch chose, each expert at the bytes
it holds: int8, MXFP4, FP8 or paged mixed precisions), KV cache excluded.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Protocol

import torch

from moekit.engine.loader import Engine
from moekit.engine.meter import decode_step_bytes
from moekit.errors import MoekitError


@dataclass(frozen=True)
class BenchSettings:
    batches: tuple[int, ...] = (1, 8)
    tokens: int = 32  # N new tokens per row
    prompt_len: int = 16
    repeats: int = 3
    warmup: int = 1
    seed: int = 0


class Baseline(Protocol):
    """What a named baseline gives the harness: its own decode tok/s and greedy tokens on our prompts."""

    name: str

    def supports(self, batch: int) -> bool: ...

    def timer(self, prompts: torch.Tensor, new_tokens: int) -> Callable[[], float]: ...

    def tokens(self, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]: ...

    def info(self) -> dict: ...


BASELINES = ("transformers", "llama.cpp")


def decode_baseline(vs: Optional[str], engine: Engine, weights: str = "dtype",
                    llama_cpp_root=None) -> Optional[Baseline]:
    """The named baseline at the engine's precision, or None; a mismatch is refused before the
    baseline loads. (With --weights int8 the roofline counts the routed experts' int8 bytes and every
    other weight at the dtype's bytes, as the meter does.)"""
    if vs is None:
        return None
    if vs not in BASELINES:
        raise MoekitError(f"--vs {vs}: the baselines are {', '.join(BASELINES)}")
    if vs == "transformers":
        if weights != "dtype":
            raise MoekitError(f"--vs transformers runs the checkpoint's own weights: drop --weights {weights}")
        from moekit.bench.transformers_baseline import TransformersBaseline

        return TransformersBaseline(engine.folder, engine.dtype, engine.device)
    from moekit.bench.llama_cpp import LlamaCppBaseline, ensure_gguf, find_build, gguf_type

    if engine.device != "cpu":
        raise MoekitError("--vs llama.cpp: the llama.cpp build here is CPU only")
    outtype = gguf_type(engine.dtype, weights)
    build = find_build(llama_cpp_root)
    return LlamaCppBaseline(build, ensure_gguf(build, engine.folder, outtype), torch.get_num_threads())


@dataclass(frozen=True)
class BatchResult:
    batch: int
    moekit_tok_s: float
    baseline: Optional[str]  # its name; None without one, or where it does not run this batch
    baseline_tok_s: Optional[float]
    bytes_per_step: float  # mean over decode steps; experts at their own bytes (meter.pass_bytes)
    roofline_tok_s: Optional[float]  # B x bandwidth / bytes_per_step
    same_tokens: Optional[bool]  # greedy outputs identical on both sides

    @property
    def ratio(self) -> Optional[float]:
        if not self.baseline_tok_s:
            return None
        return self.moekit_tok_s / self.baseline_tok_s

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
    """(mean bytes one decode step reads, greedy tokens) from one metered run."""
    gen = engine.generate(prompts.tolist(), max_new_tokens=settings.tokens, stop_ids=())
    steps = decode_step_bytes(engine.spec, gen, engine.bytes_per_param, engine.expert_bytes, engine.dense_saving)
    return statistics.fmean(steps), gen.token_ids


def bench_decode(
    engine: Engine,
    settings: BenchSettings,
    baseline: Optional[Baseline],
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
    results = []
    for batch in settings.batches:
        prompts = bench_prompts(engine.spec.vocab_size, batch, settings.prompt_len, settings.seed + batch)
        theirs = baseline if baseline is not None and baseline.supports(batch) else None
        sides = [moekit_timer(engine, prompts, settings)]
        if theirs is not None:
            sides.append(theirs.timer(prompts, settings.tokens))
        medians = _interleaved_medians(sides, settings.repeats, settings.warmup)
        step_bytes, our_tokens = moekit_metered(engine, prompts, settings)
        same = theirs.tokens(prompts, settings.tokens) == our_tokens if theirs is not None else None
        roof = batch * bandwidth_bytes_s / step_bytes if bandwidth_bytes_s else None
        results.append(BatchResult(batch, medians[0], theirs.name if theirs else None,
                                   medians[1] if theirs else None, step_bytes, roof, same))
    return results
