"""One-row products (a batch-1 decode step's) at qwen3_moe-150m's shapes, moekit's operators against
llama.cpp's (ggml's CPU mul_mat / mul_mat_id: benchmarks/ggml_rows.cpp, built here as a plain
library against bench-out/llama.cpp's libggml and called through ctypes) and a streaming read of as
many bytes (the ceiling), all in one process, taking turns within each round (a noisy neighbour
slows all alike; the order reversed every other round). Each side reads --bytes of weight a
sample, from distinct copies (from memory, not the last-level cache); medians of the rounds after
the first, as ms per product and GB/s of the bytes it reads. --clock cpu (1 thread) times the
calling thread's CPU time, which a loaded machine's waits for a core do not inflate.

    PYTHONPATH=src .venv/bin/python benchmarks/row_products.py --kinds float32,q8_0 --threads 1 --clock cpu
    PYTHONPATH=src .venv/bin/python benchmarks/row_products.py --against /tmp/base/src/moekit/ops/csrc
    PYTHONPATH=src .venv/bin/python benchmarks/row_products.py --kinds bfloat16,tiles --shapes oss_head,oss_qkv,oss_o --bytes 1200000000

--against CSRC times the same operators built from another version of csrc/ beside this tree's
(this tree's as the namespace rows_this, the other's as its native build, found in the cache where
that tree has run; a first run builds them, minutes), and says whether their outputs are equal.

Shapes (D 512, F 256, 32 experts, 4 chosen): the head [32000, 512], the fused qkv [1024, 512], o [512,
512], the experts' gate_up [32, 512, 512] and down [32, 512, 256] (4 chosen, one x row; llama.cpp's
graph holds gate and up as two stacks of [32, 256, 512], the same bytes).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit.ops import build as builds
from moekit.ops.q8_0 import quantize_q8_0
from moekit.ops.tiles import to_tiles

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GGML = REPO / "bench-out/llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/include"
GGML_LIBS = REPO / "bench-out/llama.cpp/server-build/bin"
EXPERTS, CHOSEN = 32, 4


@dataclass(frozen=True)
class Shape:
    name: str
    out: int
    width: int
    experts: int = 0


SHAPES = (Shape("head", 32000, 512), Shape("qkv", 1024, 512), Shape("o", 512, 512),
          Shape("gate_up", 512, 512, EXPERTS), Shape("down", 512, 256, EXPERTS),
          # gpt-oss-20b's bf16 ones (not run unless named in --shapes): lm_head, fused qkv, o
          Shape("oss_head", 201088, 2880), Shape("oss_qkv", 5120, 2880), Shape("oss_o", 2880, 4096))
DEFAULT_SHAPES = "head,qkv,o,gate_up,down"
GGML_TYPES = {"float32": 0, "q8_0": 1, "bfloat16": 2, "tiles": 2}  # tiles: bf16 in moekit's tiles layout (ggml's is plain bf16)


def ggml_library() -> ctypes.CDLL:
    """ggml_rows.cpp built against bench-out/llama.cpp's ggml (cached by the file's hash)."""
    source = HERE / "ggml_rows.cpp"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    lib = Path.home() / ".cache" / "moekit" / "bench" / f"ggml_rows-{digest}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), f"-I{GGML}", f"-L{GGML_LIBS}",
                        "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{GGML_LIBS}", "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.bench_new.restype = ctypes.c_void_p
    dll.bench_new.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int,
                              ctypes.c_longlong]
    dll.bench_run.restype = ctypes.c_double
    dll.bench_run.argtypes = [ctypes.c_void_p]
    dll.bench_copies.argtypes = [ctypes.c_void_p]
    dll.bench_free.argtypes = [ctypes.c_void_p]
    dll.stream_read.restype = ctypes.c_double
    dll.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p]
    return dll


def moekit_side(ops, kind: str, shape: Shape, total: int):
    """(one pass, copies, bytes a product reads, one call): one operator call per distinct copy."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(*((shape.experts,) if shape.experts else ()), shape.out, shape.width, generator=gen)
    x = torch.randn(1, shape.width, generator=gen)
    if kind == "q8_0":
        w = quantize_q8_0(w.reshape(-1, shape.width)).reshape(*w.shape[:-1], -1)
    elif kind in ("bfloat16", "tiles"):  # a bf16 engine's step: bf16 x too (multiplied as bf16 pairs where the CPU can)
        w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
        if kind == "tiles":
            w = to_tiles(w)
    copies = [w] + [w.clone() for _ in range(max(0, total // (w.nbytes // shape.experts * CHOSEN if shape.experts else w.nbytes) - 1))]
    # Copy i's call chooses experts i, i + 8, i + 16, i + 24 (mod 32): over the copies a pass reads
    # every expert of a stack, not the same four of each (those few would stay in the last-level cache).
    ids = [(torch.arange(CHOSEN)[None] * (EXPERTS // CHOSEN) + i) % EXPERTS for i in range(len(copies))]
    rows, experts = (ops.rows_q8, ops.experts_q8) if kind == "q8_0" else (ops.rows_gemv, ops.experts_gemv)
    if kind == "tiles":
        rows, experts = (lambda x1, c, _: ops.rows_tiles(x1, c)), (lambda x1, c, i, _: ops.experts_tiles(x1, c, i))
    if shape.experts:
        call = lambda c, i: experts(x[:, None], c, ids[i], True)  # noqa: E731
        read = w[0].nbytes * CHOSEN
    else:
        call = lambda c, i: rows(x, c, True)  # noqa: E731
        read = w.nbytes

    def one_pass() -> None:
        for i, c in enumerate(copies):
            call(c, i)

    return one_pass, len(copies), read, lambda: call(copies[0], 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="float32,q8_0")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"of {','.join(s.name for s in SHAPES)}")
    parser.add_argument("--bytes", type=int, default=128 << 20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--isa", default="native", choices=["native", "avx2"], help="which build of this tree runs (without --against)")
    parser.add_argument("--against", type=Path, help="another version's src/moekit/ops/csrc, timed beside this tree's")
    parser.add_argument("--no-ggml", action="store_true", help="leave llama.cpp's side out")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: the calling thread's CPU time (1 thread only: every side then runs on it), which a loaded "
                             "machine's waits for a core do not inflate")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != "1":
        raise SystemExit("--clock cpu times the calling thread: --threads 1 only")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    if args.against:  # this tree's as rows_this, the other's as its own native build (moekit; cached where that tree ran)
        sides = {}
        for name, variant, csrc in (("this", builds.Variant("rows_this", "", ("-march=native",)), builds.CSRC),
                                    ("against", builds.NATIVE, args.against)):
            result = builds.build(variant, csrc=csrc)
            if not result.ok:
                raise SystemExit(result.line())
            sides[name] = getattr(torch.ops, variant.namespace)
    else:
        variant = builds.NATIVE if args.isa == "native" else builds.NARROW
        result = builds.build(variant)
        if not result.ok:
            raise SystemExit(result.line())
        ops = getattr(torch.ops, variant.namespace)
        sides = {"moekit": _Suffixed(ops, variant.suffix)}
    dll = None if args.no_ggml else ggml_library()
    big = torch.ones(args.bytes // 4)
    sink = ctypes.c_float()
    shapes = [s for s in SHAPES if s.name in args.shapes.split(",")]
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}; {args.clock} clock")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for kind in args.kinds.split(","):
            for shape in shapes:
                runs, copies, read, firsts = {}, {}, 0, []
                for name, ops in sides.items():
                    runs[name], copies[name], read, first = moekit_side(ops, kind, shape, args.bytes)
                    firsts.append(first)
                if len(firsts) == 2:
                    print(f"  {kind} {shape.name}: outputs equal: {torch.equal(firsts[0](), firsts[1]())}")
                bench = None
                if dll is not None:
                    bench = dll.bench_new(GGML_TYPES[kind], shape.out, shape.width, shape.experts, CHOSEN if shape.experts else 0,
                                          threads, args.bytes)
                    runs["llama.cpp"], copies["llama.cpp"] = (lambda b=bench: dll.bench_run(b)), dll.bench_copies(bench)
                runs["read"], copies["read"] = (lambda: dll.stream_read(big.data_ptr(), big.numel(), threads, ctypes.byref(sink))) \
                    if dll is not None else (lambda: big.sum()), args.bytes / read
                times = {name: [] for name in runs}
                for r in range(args.rounds + 1):  # the order reversed every other round: no side always follows the same one
                    for name, run in (list(runs.items()) if r % 2 == 0 else list(runs.items())[::-1]):
                        began = clock()
                        run()
                        times[name].append((clock() - began) / copies[name])
                cells = []
                for name, ts in times.items():
                    per = statistics.median(ts[1:])
                    cells.append(f"{name} {per * 1e3:.3f} ms {read / per / 1e9:.1f} GB/s")
                print(f"{kind:8s} {shape.name:8s} threads {threads}: " + " | ".join(cells), flush=True)
                if bench is not None:
                    dll.bench_free(bench)
    print(f"load average at end: {open('/proc/loadavg').read().split()[:3]}")


class _Suffixed:
    """A build's operators by their plain names (the AVX2 build's end in _avx2)."""

    def __init__(self, ops, suffix: str):
        self._ops, self._suffix = ops, suffix

    def __getattr__(self, name: str):
        return getattr(self._ops, name + self._suffix)


if __name__ == "__main__":
    main()
