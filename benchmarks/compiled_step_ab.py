"""This tree's compiled decode step against another version of src/moekit/model/compiled_step.py,
in one process: four engines of one checkpoint placed this, other, other, this (benchmarks/abba.py).

    git show 9b7951b:src/moekit/model/compiled_step.py > /tmp/step_before.py
    .venv/bin/python benchmarks/compiled_step_ab.py bench-out/ckpt/qwen3_moe-150m --against /tmp/step_before.py

--this puts another file on the A side (two edited copies against each other, e.g. each forcing
one build of the operators). --hollow swaps the product operators for ones that only allocate their
outputs, in both versions, so the times are everything in a step but its products (the graph's
other kernels, Dynamo, the caller).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from unittest import mock

import torch

from abba import PLACEMENT, abba_ms, timed_ms  # benchmarks/, on sys.path as the script's folder
from moekit.engine.loader import load_engine
from moekit.model.decoder import Decoder

HERE = Path(__file__).resolve().parents[1] / "src/moekit/model/compiled_step.py"

HOLLOW = Path(__file__).resolve().parent / "hollow_operators.cpp"


def hollow_operators() -> None:
    from torch.utils.cpp_extension import load

    load(name="bench_hollow_gemv3", sources=[str(HOLLOW)], is_python_module=False, extra_cflags=["-O2"])
    torch.library.register_fake("hollow::rows_gemv")(lambda x, w, grouped=False: x.new_empty((x.shape[0], w.shape[0])))
    for name in ("experts_gemv", "hollow_experts_tiles"):
        torch.library.register_fake(f"hollow::{name}")(
            lambda x, w, ids, grouped=False: x.new_empty((x.shape[0], ids.shape[1], w.shape[1])))
    torch.library.register_fake("hollow::hollow_rows_tiles")(lambda x, w, grouped=False: x.new_empty((x.shape[0], w.shape[0])))


def step_module(path: Path, name: str, hollow: bool):
    """compiled_step.py at `path` as a module of its own (hollow: calling the hollow operators)."""
    source = path.read_text()
    if hollow:
        chooser = "return getattr(torch.ops, _namespace(gemv.kind_of(weight)))"  # older versions' one call site
        source = source.replace(chooser, "return torch.ops.hollow")
        chooser = "return gemv.op(_namespace(gemv.kind_of(weight)), name)"  # versions with moekit.model.gemv
        source = source.replace(chooser, "return getattr(torch.ops.hollow, name)")
        chooser = "return ops.op(_namespace(ops.kind_of(weight)), name)"  # this tree's (moekit.ops)
        source = source.replace(chooser, "return getattr(torch.ops.hollow, name)")
        source = source.replace("torch.ops.moekit.rows_gemv", "torch.ops.hollow.rows_gemv")  # older versions
        source = source.replace("torch.ops.moekit.experts_gemv", "torch.ops.hollow.experts_gemv")
        for name in ("rows_tiles", "experts_tiles"):  # the tiles' operators (this tree's, AMX machines)
            source = source.replace(f'gemv.op("moekit", "{name}")', f"torch.ops.hollow.hollow_{name}")
            source = source.replace(f'ops.op("moekit", "{name}")', f"torch.ops.hollow.hollow_{name}")
        if "torch.ops.hollow" not in source:
            raise SystemExit(f"{path}: found no gemv call to hollow out")
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--against", type=Path, required=True, help="another compiled_step.py")
    parser.add_argument("--this", type=Path, default=HERE, help="the A side (default: this tree's compiled_step.py)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=16, help="cache slots filled before the timed steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--hollow", action="store_true", help="time everything but the products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.hollow:
        hollow_operators()
    versions = {"this": step_module(args.this, "step_this", args.hollow),
                "other": step_module(args.against, "step_other", args.hollow)}
    decoders = []
    for side in PLACEMENT:  # A: this tree's step, B: the other
        # Loaded for compiling but without this tree's step installed: a step may lay the weights
        # out for itself (tiles), which the other version must not find done.
        with mock.patch.object(Decoder, "compile_decode", lambda self, cpp_wrapper=True: None):
            decoder = load_engine(args.checkpoint, dtype=args.dtype, compile=True).decoder
        decoder.compiled = versions["this" if side == "a" else "other"].CompiledStep(decoder)
        decoders.append(decoder)
    b, lo, hi = args.batch, args.context, args.context + args.steps
    caches = [d.new_cache(b, hi) for d in decoders]
    tokens = torch.randint(0, 1000, (hi, b, 1), generator=torch.Generator().manual_seed(0))

    def decode(i: int, first: int, last: int) -> list[torch.Tensor]:
        dec, cache, out = decoders[i], caches[i], []
        for s in range(first, last):
            slot = torch.full((b,), s)
            out.append(dec.compiled(tokens[s], cache, slot, slot, cache.key_mask[:, : s + 1]).logits)
        return out

    with torch.inference_mode():
        logits = [decode(i, 0, hi) for i in range(4)]  # compiles; fills the cache
        if not args.hollow:
            diff = max((x - y).abs().max().item() for x, y in zip(logits[0], logits[1]))
            print(f"largest logit difference, this vs other: {diff:.3g}")
        this, other = abba_ms(lambda i: timed_ms(lambda: decode(i, lo, hi), args.steps), args.rounds)
    what = "a step without its products" if args.hollow else "a step"
    print(f"{args.checkpoint} {args.dtype} batch {b}, context {lo}, {args.threads} threads, {what}: "
          f"this {this:.3f} ms, other {other:.3f} ms, this / other = {this / other:.3f} "
          f"(medians of {args.rounds} rounds of {args.steps} steps)")


if __name__ == "__main__":
    main()
