"""Which options combine: the one place that decides, and refuses a combination in one line.

Two questions, asked at two times:
  - `refusal(Options)`, before anything loads (the run and serve commands, load_engine, attach_store):
    a combination the engine does not run at all (expert parallelism with an explicit --compile
    outside the server, int8 weights, routing policies or --no-verify; the store's flags without
    --expert-memory; the store off the CPU). The compiled step is the default (`decode_compiled`):
    where the default meets a combination that does not compile (`run --expert-parallel`), the run
    is eager with one note; only an explicit --compile is refused.
  - `compile_refusal(decoder)`, once a decoder is built: why its decode step cannot be compiled; the
    engine then stays eager and says so in one note (MXFP4/FP8 experts kept packed without their
    operators, a device other than the CPU...). Each expert weight form says for itself whether the
    compiled step reads it (moekit.model.expert_forms). A quantized checkpoint's dense projections
    are dequantized at load (moekit.weights.quantized), so they are in the Hub layout.
What combines without a word: per-row K (tiers) with --compile (a graph of its own); routing
policies with --compile (one opaque op per MoE layer in the graph: moekit.model.seated_policy); the
store with --compile (its layers and prefetch guesses are opaque ops in the graph:
moekit.offload.graph_store); MXFP4 / FP8 experts kept packed with --compile; the store with tiers,
policies and prefetch; packed experts with the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moekit.errors import MoekitError


@dataclass(frozen=True)
class Options:
    """A run's options, as far as which of them combine goes."""

    compile: bool = False  # an explicit --compile (the default's compiled step falls back instead)
    paged: bool = False  # --expert-memory: routed experts paged by the expert store
    store_flags: tuple[str, ...] = ()  # the store's own flags given (--cache, --pin, --prefetch, --substitute, --expert-split, --direct-io)
    expert_parallel: bool = False
    weights: str = "dtype"
    routing: bool = False  # a routing policy (--routing)
    no_verify: bool = False
    admin_token: bool = False
    device: str = "cpu"
    served: bool = False  # `moekit serve`: its sharded step compiles (the exchange an opaque op in the graph)


CPU_ONLY = "the compiled decode step is built and tested for CPU only"


def refusal(o: Options) -> Optional[str]:
    """The first combination of `o` the engine does not run, in one line; None when they combine."""
    if o.store_flags and not o.paged:
        return f"the expert store's flags ({', '.join(o.store_flags)}) need --expert-memory"
    if o.paged and o.device != "cpu":
        return "--expert-memory runs on CPU only in this version (the CUDA tier is not built yet)"
    if o.expert_parallel:
        for flag, used in (("--compile", o.compile and not o.served), (f"--weights {o.weights}", o.weights != "dtype"),
                           ("--routing", o.routing), ("--no-verify", o.no_verify),
                           ("--admin-token with --expert-memory", o.admin_token and o.paged)):
            if used:
                return f"{flag} with --expert-parallel is not supported yet"
    return None


def decode_compiled(asked: Optional[bool], kernels: str = "auto") -> bool:
    """Whether a run's decode steps are compiled: `asked` is --compile (True), --eager (False) or
    neither (None). Compiled is the default, except with --kernels reference: the reference path is
    the plain eager one (an explicit --compile still compiles it, without moekit's operators)."""
    return kernels != "reference" if asked is None else asked


def store_flags(cache: str = "lru", pin=None, prefetch: bool = False, substitute=None, split=None,
                direct_io: bool = False) -> tuple[str, ...]:
    """The expert store's flags a command was given (each at a value other than its default)."""
    given = (("--cache", cache != "lru"), ("--pin", pin is not None), ("--prefetch", bool(prefetch)),
             ("--substitute", substitute is not None), ("--expert-split", split is not None),
             ("--direct-io", bool(direct_io)))
    return tuple(flag for flag, used in given if used)


def check(o: Options) -> None:
    """Raise refusal(o) as the one-line error a command prints (exit 2), if there is one."""
    reason = refusal(o)
    if reason is not None:
        raise MoekitError(reason)


def compile_refusal(decoder) -> Optional[str]:
    """Why this decoder's decode step cannot be compiled here, or None when it can."""
    from moekit.model.attention import Attention
    from moekit.model.linear import INT8, INT8_GEMV, PLAIN, TILES, Linear
    from moekit.model.mla import MLAttention
    from moekit.model.moe import MoE
    from moekit.model.norms import LayerNorm, RMSNorm
    from moekit.model.step_ops import has_gemv

    if decoder.device.type != "cpu":
        return CPU_ONLY
    moes = [block.ffn.experts for block in decoder.layers if isinstance(block.ffn, MoE)]
    # First: a paged layer's own reason (no store attached yet), whatever its projections' layout.
    paged = next((reason for ex in moes if ex.offloaded and (reason := ex.held.compiles())), None)
    if paged is not None:
        return paged
    linears = [m for m in decoder.modules() if isinstance(m, Linear)]
    if any(m.kernel not in (PLAIN, TILES, INT8, INT8_GEMV) for m in linears):
        return "projections are not in the Hub layout (laid out for the eager kernels)"
    if any(m.kernel is not PLAIN for m in linears) and not has_gemv():
        return "int8 weights need the gemv operators, which this process has not loaded (--kernels reference, or their build failed)"
    for block in decoder.layers:
        if any(hook is not None and not getattr(hook, "opaque", False) for hook in (block.before_attn, block.before_ffn)):
            return "a hook before attention or the feed-forward runs Python the step cannot call (the prefetch guesses' can)"
        attn = block.attn
        if isinstance(attn, MLAttention):
            if attn.x_proj is None:
                return "latent attention is not prepared (its fused projection is missing)"
        elif not isinstance(attn, Attention):
            return f"{type(attn).__name__} layers are not in the compiled step yet"
        for norm in (block.input_norm, block.post_norm):
            if not isinstance(norm, (RMSNorm, LayerNorm)):
                return f"{type(norm).__name__} is not in the compiled step"
    return next((reason for ex in moes if (reason := ex.held.compiles())), None)
