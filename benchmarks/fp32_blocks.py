"""fp32 batch products by block shape: G weight rows x R x rows at once (rows.h's dot_block), at a
served model's shapes, for each ISA build (AVX-512 and AVX2 where both are built), 1 and 2 threads.

The blocks are built here from benchmarks/fp32_blocks.cpp, which runs the operators' own loops
(rows_loop, experts_loop) around a block picked at run time; every block gives the same floats
(checked against the operator first, bit for bit). Each weight is read from memory: distinct copies,
--bytes in all, one pass over them a sample; the blocks take turns within each round (a noisy
neighbour slows all alike), the first round left out; medians per pass over one weight, in CPU ms
(the process's; wall ms in brackets: on a shared machine it counts the waits for a core too).

    PYTHONPATH=src .venv/bin/python benchmarks/fp32_blocks.py --rows 1,2,4,8,16 --threads 1,2

The first run builds the blocks (~1.5 CPU minutes a build; 15-24 minutes on the shared machine at
the lowest priority), cached under ~/.cache/moekit/bench by the hash of csrc/ and this file.

Shapes are qwen3_moe-150m's (benchmarks/make_checkpoints.py): the head [32000, 512], the fused qkv
[1024, 512], o [512, 512], the experts' gate_up [32, 512, 512] and down [32, 512, 256], each row
choosing 4 of 32 experts (seeded).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit import ops
from moekit.ops.build import CSRC, Variant, machine_variants, sources_digest

HERE = Path(__file__).resolve().parent
BLOCKS = ((1, 1), (1, 2), (1, 4), (1, 6), (1, 8), (2, 2), (2, 4), (2, 8))  # (G, R): fp32_blocks.cpp's MK_BLOCKS
EXPERTS, CHOSEN = 32, 4


@dataclass(frozen=True)
class Shape:
    """One product of the step: a weight [N, K] (rows) or a stack [E, N, K] of experts (per_choice:
    one x row per choice, as the down projection)."""

    name: str
    out: int
    width: int
    experts: int = 0
    per_choice: bool = False


SHAPES = (Shape("head", 32000, 512), Shape("qkv", 1024, 512), Shape("o", 512, 512),
          Shape("gate_up", 512, 512, EXPERTS), Shape("down", 512, 256, EXPERTS, per_choice=True))


def build_blocks(variant: Variant) -> str:
    """Builds fp32_blocks.cpp for one ISA variant (cached by the sources' hash); its namespace."""
    from torch.utils.cpp_extension import load

    name = "fp32_blocks" + variant.suffix
    digest = hashlib.sha256((sources_digest(CSRC) + (HERE / "fp32_blocks.cpp").read_text()).encode()).hexdigest()[:16]
    folder = Path.home() / ".cache" / "moekit" / "bench" / f"{name}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    load(name=name, sources=[str(HERE / "fp32_blocks.cpp")], extra_cflags=["-O3", "-fopenmp", *variant.isa_flags,
         f"-DBENCH_NAMESPACE={name}"], extra_include_paths=[str(CSRC)], build_directory=str(folder),
         is_python_module=False, verbose=False)
    return name


def weights(shape: Shape, total: int) -> list[torch.Tensor]:
    """Distinct copies of a random weight of this shape, `total` bytes in all (at least one)."""
    w = torch.randn(*((shape.experts,) if shape.experts else ()), shape.out, shape.width, generator=torch.Generator().manual_seed(1))
    return [w] + [w.clone() for _ in range(max(0, total // w.nbytes - 1))]


def inputs(shape: Shape, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(rows)
    if not shape.experts:
        return torch.randn(rows, shape.width, generator=gen), None
    ids = torch.stack([torch.randperm(shape.experts, generator=gen)[:CHOSEN] for _ in range(rows)])
    return torch.randn(rows, CHOSEN if shape.per_choice else 1, shape.width, generator=gen), ids


def sides(space: str, operator_space: str, shape: Shape, x: torch.Tensor, ids) -> dict:
    """name → fn(w): each block, and the operator as built (its own Block)."""
    ns = getattr(torch.ops, space)
    out = {}
    for g, r in BLOCKS:
        if shape.experts:
            out[f"G{g} R{r}"] = lambda w, g=g, r=r: ns.experts(x, w, ids, g, r)
        else:
            out[f"G{g} R{r}"] = lambda w, g=g, r=r: ns.rows(x, w, g, r)
    product = ops.op(operator_space, "experts_gemv" if shape.experts else "rows_gemv")
    out["operator"] = (lambda w: product(x, w, ids, False)) if shape.experts else (lambda w: product(x, w, False))
    return out


def medians(fns: dict, copies: list[torch.Tensor], rounds: int) -> dict:
    """name → (median wall ms, median CPU ms) per pass over one weight. The CPU time (the process's,
    all its threads) is what a pass costs when it runs: on a shared machine the wall time also counts
    the time the process waited for a core."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            for w in copies:
                fn(w)
            times[name].append(((time.perf_counter() - wall) / len(copies) * 1e3, (time.process_time() - cpu) / len(copies) * 1e3))
    return {name: tuple(statistics.median(s[i] for s in t[1:]) for i in (0, 1)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--builds", default="", help="comma-separated namespaces (default: every build here)")
    parser.add_argument("--bytes", type=int, default=128 << 20, help="weight bytes per sample (past the caches)")
    args = parser.parse_args()
    loaded = ops.load()
    if not loaded.ok:
        raise SystemExit(loaded.failures()[0])
    print(f"load average {os.getloadavg()}; torch {torch.__version__}; {torch.backends.cpu.get_cpu_capability()}")
    print(f"fp32 one-row choice here: {ops.variant('float32').label}")
    builds = {v: build_blocks(v) for v in machine_variants() if not args.builds or v.namespace in args.builds.split(",")}
    for shape in (s for s in SHAPES if s.name in args.shapes.split(",")):
        copies = weights(shape, args.bytes)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for variant, space in builds.items():
                for rows in (int(r) for r in args.rows.split(",")):
                    x, ids = inputs(shape, rows)
                    fns = sides(space, variant.namespace, shape, x, ids)
                    want = fns["operator"](copies[0])
                    assert all(torch.equal(fn(copies[0]), want) for fn in fns.values()), f"{shape.name}: a block's floats differ"
                    ms = medians(fns, copies, args.rounds)
                    best = min(ms, key=lambda name: ms[name][1])
                    cells = "  ".join(f"{name} {cpu:.2f} ({wall:.2f})" for name, (wall, cpu) in ms.items())
                    print(f"{shape.name} {threads}t {variant.namespace:<11} rows {rows:>2}: {cells}  | least CPU {best}"
                          f"  load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
