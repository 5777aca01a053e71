"""Where a prefill's time goes: the eager forward over one prompt of T tokens, by part.

Loads a checkpoint twice over (the layout `moekit run` prepares for the eager kernels, and the Hub
layout the compiled decode step reads, which a compiled engine's prefill runs on too), prefills
prompts of each length a few times and prints, per (dtype, layout, T): the wall time, prefill
tok/s, and the share of it spent in attention's projections (qkv, o), attention's own work
(norms, RoPE, cache writes, SDPA), the router, the routed experts, the other parts (norms, embed,
head), and the Python between operators (wall minus the operators' time, from torch.profiler).

  PYTHONPATH=src .venv/bin/python benchmarks/prefill_breakdown.py CKPT --lengths 8 64 512 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from moekit.engine.loader import torch_dtype
from moekit.model.attention import Attention
from moekit.model.decoder import Decoder
from moekit.model.experts import RoutedExperts
from moekit.model.mla import MLAttention
from moekit.model.moe import Router
from moekit.weights.checkpoint import open_checkpoint
from moekit.weights.gguf_spec import load_any_spec


def load(folder: Path, dtype: str, kernels: bool) -> Decoder:
    spec = load_any_spec(folder)
    decoder = Decoder(spec, dtype=torch_dtype(dtype))
    ckpt = open_checkpoint(folder)
    decoder.load_checkpoint(ckpt, kernels=kernels)
    ckpt.close()
    return decoder.eval()


def timed_parts(decoder: Decoder) -> tuple[dict, list]:
    """Forward hooks adding each part's wall time into a dict (inclusive: attention includes its projections)."""
    spent: dict = defaultdict(float)
    handles = []

    def watch(module, name):
        def before(*_):
            module._t0 = time.perf_counter()

        def after(*_):
            spent[name] += time.perf_counter() - module._t0

        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))

    for block in decoder.layers:
        if isinstance(block.attn, (Attention, MLAttention)):
            watch(block.attn, "attention")
            for name, sub in block.attn.named_children():
                if name in ("qkv", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "q_proj"):
                    watch(sub, "attn projections")
        for sub in block.ffn.modules():
            if isinstance(sub, Router):
                watch(sub, "router")
            elif isinstance(sub, RoutedExperts):
                watch(sub, "routed experts")
        if getattr(block.ffn, "shared", None) is not None:
            watch(block.ffn.shared, "shared experts")
    return spent, handles


def prefill_once(decoder: Decoder, ids: torch.Tensor) -> float:
    cache = decoder.new_cache(1, ids.shape[1])
    positions = torch.arange(ids.shape[1])[None]
    start = time.perf_counter()
    decoder(ids, cache, positions, last_only=True)
    return time.perf_counter() - start


def operator_seconds(decoder: Decoder, ids: torch.Tensor) -> tuple[float, float]:
    """(wall, seconds inside aten operators) of one prefill under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = prefill_once(decoder, ids)
    ops = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::") or e.key.startswith("moekit::"))
    return wall, ops / 1e6


def breakdown(decoder: Decoder, length: int, repeats: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(3, vocab, (1, length), generator=gen)
    with torch.inference_mode():
        prefill_once(decoder, ids)  # warm
        walls = sorted(prefill_once(decoder, ids) for _ in range(repeats))
        spent, handles = timed_parts(decoder)
        hooked = sorted(prefill_once(decoder, ids) for _ in range(repeats))
        for h in handles:
            h.remove()
        prof_wall, in_ops = operator_seconds(decoder, ids)
    wall = walls[len(walls) // 2]
    parts = {k: v / repeats for k, v in spent.items()}
    attention_own = parts.get("attention", 0.0) - parts.get("attn projections", 0.0)
    hooked_wall = hooked[len(hooked) // 2]
    rest = hooked_wall - parts.get("attention", 0.0) - parts.get("router", 0.0) - parts.get("routed experts", 0.0) - parts.get("shared experts", 0.0)
    share = {
        "attn projections": parts.get("attn projections", 0.0),
        "attention (norms, rope, cache, sdpa)": attention_own,
        "router": parts.get("router", 0.0),
        "routed experts": parts.get("routed experts", 0.0),
        "shared experts": parts.get("shared experts", 0.0),
        "rest (embed, norms, head)": rest,
    }
    return {
        "T": length,
        "wall_ms": wall * 1e3,
        "tok_s": length / wall,
        "parts_ms": {k: round(v * 1e3, 3) for k, v in share.items() if v},
        "python_share": max(0.0, 1 - in_ops / prof_wall),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--layouts", nargs="+", default=["eager", "hub"], help="eager: kernels=True; hub: the compiled step's layout")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes:
        for layout in args.layouts:
            decoder = load(args.checkpoint, dtype, kernels=layout == "eager")
            for length in args.lengths:
                row = breakdown(decoder, length, args.repeats, decoder.spec.vocab_size)
                print(json.dumps({"dtype": dtype, "layout": layout, **row}), flush=True)
            del decoder


if __name__ == "__main__":
    main()
