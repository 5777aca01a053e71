"""One moekit decode run for `moekit bench offload`, in a child process so its peak RSS is its own.

    python -m moekit.bench.offload_worker --folder F --expert-memory 25% --policy lru \
        --prompt-ids 1,2,3 --new-tokens 32 --threads 1 --dtype bfloat16 --json

prints one JSON line: decode tokens/s, the generated ids, the store's report, and the memory
figures the RSS bound is checked against (RSS before loading, peak RSS, dense and budget bytes).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from moekit.bench.child import json_main, parse_ids


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resident_bytes(decoder) -> int:
    """Bytes of every weight the decoder holds itself (with an expert store: the dense ones only)."""
    return sum(p.numel() * p.element_size() for p in decoder.parameters())


def warm_kernels(dtype) -> None:
    """Run each kind of op the engine uses once on tiny tensors, so the libraries' code and arenas
    (oneDNN's JIT, MKL, OpenMP) are resident BEFORE the baseline RSS: what the bound checks is the
    model's memory, not the first use of a shared library."""
    import torch
    import torch.nn.functional as F

    from moekit.model.linear import kernel_for

    x = torch.randn(4, 64, dtype=dtype)
    w = torch.randn(96, 64, dtype=dtype)
    kernel = kernel_for(w)  # what the engine will run here (oneDNN bf16 only where this CPU has it)
    kernel.apply(x, kernel.prepare(w), None)
    kernel.apply(x[:1], kernel.prepare(w), None)
    F.linear(x, w)
    q = torch.randn(1, 4, 8, 16, dtype=dtype)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    scores = torch.softmax(torch.randn(4, 32), dim=-1)
    ids = scores.topk(2).indices
    torch.argsort(ids.reshape(-1), stable=True)
    torch.bincount(ids.reshape(-1), minlength=32)
    torch.zeros(4, 64, dtype=dtype).index_add_(0, torch.tensor([0, 1]), x[:2])
    F.embedding(torch.tensor([1, 2]), w)


def run(folder: str, expert_memory: Optional[str], policy: str, prefetch: bool, prompt_ids: list[int],
        new_tokens: int, threads: int, dtype: str, pin: Optional[str] = None, prefetch_extra: int = 4) -> dict:
    import torch

    from moekit.engine.loader import load_engine
    from moekit.offload.options import OffloadOptions
    from moekit.offload.report import offload_report, peak_rss_bytes

    torch.set_num_threads(threads)
    warm_kernels(getattr(torch, dtype))
    before = current_rss_bytes()
    offload = None
    if expert_memory is not None:
        offload = OffloadOptions(expert_memory=expert_memory, policy=policy, prefetch=prefetch, prefetch_extra=prefetch_extra,
                                 pin=None if pin is None else Path(pin))
    engine = load_engine(folder, dtype=dtype, offload=offload, compile=False)  # the eager step, as the figures were measured
    after_load = current_rss_bytes()
    try:
        snapshot: dict = {}

        def on_token(step, ids):
            if step == 0 and engine.store is not None:
                snapshot.update(engine.store.stats())

        with torch.inference_mode():
            gen = engine.generate(prompt_ids, max_new_tokens=new_tokens, stop_ids=(), on_token=on_token)
        after_generate = current_rss_bytes()
        report = None
        if engine.store is not None:
            report = offload_report(snapshot, engine.store.stats(), gen.timing.decode_tokens, gen.timing.decode_s)
        dense = resident_bytes(engine.decoder)
        budget = engine.store.stats()["budget_bytes"] if engine.store is not None else 0
    finally:
        engine.close()
    return {
        "expert_memory": expert_memory,
        "policy": policy if expert_memory is not None else "resident",
        "prefetch": prefetch and expert_memory is not None,
        "tokens_per_s": gen.timing.decode_tok_s,
        "prefill_s": gen.timing.prefill_s,
        "new_tokens": len(gen.token_ids[0]),
        "token_ids": gen.token_ids[0],
        "offload": report,
        "rss_before_load_bytes": before,
        "rss_after_load_bytes": after_load,
        "rss_after_generate_bytes": after_generate,
        "peak_rss_bytes": peak_rss_bytes(),
        "dense_bytes": dense,
        "budget_bytes": budget,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moekit.bench.offload_worker",
                                     description="One moekit decode run; prints one JSON line.")
    parser.add_argument("--folder", required=True)
    parser.add_argument("--expert-memory", default=None, help="omit for the fully resident engine")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--prefetch", action="store_true", help="guess and preload each layer's experts")
    parser.add_argument("--no-prefetch", action="store_true", help="(the default; accepted for symmetry)")
    parser.add_argument("--pin", default=None)
    parser.add_argument("--prefetch-extra", type=int, default=4)
    parser.add_argument("--prompt-ids", required=True)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", action="store_true", help="(always JSON; accepted for symmetry)")
    args = parser.parse_args(argv)
    return json_main(lambda: run(args.folder, args.expert_memory, args.policy, args.prefetch and not args.no_prefetch,
                                 parse_ids(args.prompt_ids), args.new_tokens, args.threads, args.dtype, args.pin,
                                 args.prefetch_extra))

if __name__ == "__main__":
    sys.exit(main())
