"""Bytes per token the meter reports for each weight format, ~150M shape, against `moekit calc`.

Every row is one `moekit run CKPT --prompt-ids ... --json` (the CLI a user runs; `moekit serve`'s
usage and `moekit bench decode` count through the same meter.pass_bytes), its bytes_touched
averaged over the generated tokens, and `moekit calc CKPT --dtype D --json`'s batch-1 weight bytes
per decode step. Ratios are to the same model's fp32 row.

  qwen3_moe-150m        benchmarks/make_checkpoints.py (D 512, 8 layers, 32 experts top-4)
                        fp32, bf16, --weights int8-experts, --weights int8, and llama.cpp's Q8_0
                        GGUF of it (dequantized at load; with --weights int8, its own q8_0 blocks)
  gpt_oss-150m(-mxfp4)  benchmarks/quantized_formats.py: bf16 original and MXFP4 experts
  deepseek_v3-150m(-fp8)  likewise, FP8 (128x128 blocks) projections

    .venv/bin/python benchmarks/make_checkpoints.py --sizes 150m --families qwen3_moe,deepseek_v3
    .venv/bin/python benchmarks/meter_bytes.py [--new 8]

The Q8_0 GGUF is taken from bench-out/llama.cpp/gguf/ (`moekit bench decode CKPT --vs llama.cpp`
makes it) or made here with llama.cpp's converter when benchmarks/build_llama_cpp.sh has run;
otherwise its rows are left out and the script says so. bench-out/ is git-ignored.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CKPT = REPO / "bench-out" / "ckpt"
GGUF = REPO / "bench-out" / "llama.cpp" / "gguf"
PROMPT = [1, 17, 42, 99, 5, 63, 120, 7, 300, 2048, 11, 12]


@dataclass(frozen=True)
class Row:
    model: str  # the model whose fp32 row the ratio is to
    label: str
    source: Path
    dtype: str  # moekit run --dtype
    weights: str  # moekit run --weights
    calc_dtype: str  # moekit calc --dtype


def moekit(*args) -> dict:
    done = subprocess.run([sys.executable, "-m", "moekit", *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"moekit {' '.join(map(str, args))}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout)


def metered(row: Row, new: int) -> float:
    """Mean bytes_touched per generated token of `moekit run --json`."""
    out = moekit("run", row.source, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", new,
                 "--stop", "", "--dtype", row.dtype, "--weights", row.weights, "--json")
    tokens = out["activation"]
    return sum(t["bytes_touched"] for t in tokens) / len(tokens)


def calc_bytes(row: Row) -> int:
    """`moekit calc`'s weight bytes one batch-1 decode step reads, every weight at calc_dtype."""
    return moekit("calc", row.source, "--dtype", row.calc_dtype, "--json")["traffic"]["batch1"]["weight_bytes"]


def q8_0_gguf(folder: Path) -> Path | None:
    found = sorted(GGUF.glob(f"{folder.name}-*-q8_0.gguf"))
    if found:
        return found[0]
    from moekit.bench.llama_cpp import ensure_gguf, find_build
    from moekit.errors import MoekitError

    try:
        return ensure_gguf(find_build(), folder, "q8_0")
    except MoekitError as err:
        print(f"note: no Q8_0 GGUF of {folder.name}, its rows are left out ({err})", file=sys.stderr)
        return None


def make_missing(root: Path) -> None:
    """The quantized checkpoints from their bf16 originals, as benchmarks/quantized_formats.py does."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import quantized_formats as qf

    for name in ("qwen3_moe-150m", "deepseek_v3-150m"):
        if not (root / name / "config.json").is_file():
            raise SystemExit(f"{root / name}: missing; run benchmarks/make_checkpoints.py --sizes 150m "
                             "--families qwen3_moe,deepseek_v3")
    if not (root / "gpt_oss-150m" / "config.json").is_file():
        qf.make_gpt_oss(root / "gpt_oss-150m")
    if not (root / "gpt_oss-150m-mxfp4" / "config.json").is_file():
        qf.make_mxfp4(root / "gpt_oss-150m", root / "gpt_oss-150m-mxfp4")
    if not (root / "deepseek_v3-150m-fp8" / "config.json").is_file():
        qf.make_fp8(root / "deepseek_v3-150m", root / "deepseek_v3-150m-fp8")


def rows(root: Path) -> list[Row]:
    qwen, oss, ds = root / "qwen3_moe-150m", root / "gpt_oss-150m", root / "deepseek_v3-150m"
    out = [
        Row("qwen3_moe", "fp32", qwen, "float32", "dtype", "fp32"),
        Row("qwen3_moe", "bf16", qwen, "bfloat16", "dtype", "bf16"),
        Row("qwen3_moe", "int8 experts (fp32 rest)", qwen, "float32", "int8-experts", "int8"),
        Row("qwen3_moe", "int8 all (fp32 activations)", qwen, "float32", "int8", "int8"),
    ]
    gguf = q8_0_gguf(qwen)
    if gguf is not None:
        out += [Row("qwen3_moe", "GGUF Q8_0, dequantized to fp32", gguf, "float32", "dtype", "int8"),
                Row("qwen3_moe", "GGUF Q8_0, --weights int8", gguf, "float32", "int8", "int8")]
    out += [
        Row("gpt_oss", "fp32", oss, "float32", "dtype", "fp32"),
        Row("gpt_oss", "bf16", oss, "bfloat16", "dtype", "bf16"),
        Row("gpt_oss", "MXFP4 experts (bf16 rest)", root / "gpt_oss-150m-mxfp4", "bfloat16", "dtype", "mxfp4"),
        Row("deepseek_v3", "fp32", ds, "float32", "dtype", "fp32"),
        Row("deepseek_v3", "bf16", ds, "bfloat16", "dtype", "bf16"),
        Row("deepseek_v3", "FP8 experts (bf16 rest)", root / "deepseek_v3-150m-fp8", "bfloat16", "dtype", "fp8"),
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=CKPT)
    parser.add_argument("--new", type=int, default=8, help="tokens generated per run (bytes are averaged over them)")
    args = parser.parse_args()
    make_missing(args.ckpt)
    table = rows(args.ckpt)
    fp32: dict[str, float] = {}
    print("| model | format | `moekit run` options | bytes/token (meter) | ratio to fp32 | `moekit calc` (--dtype) | calc / meter |")
    print("|---|---|---|---:|---:|---:|---:|")
    for row in table:
        got = metered(row, args.new)
        fp32.setdefault(row.model, got)  # each model's first row is its fp32 one
        predicted = calc_bytes(row)
        options = f"--dtype {row.dtype}" + ("" if row.weights == "dtype" else f" --weights {row.weights}")
        print(f"| {row.source.name} | {row.label} | {options} | {got:,.0f} | {got / fp32[row.model]:.3f} "
              f"| {predicted:,} ({row.calc_dtype}) | {predicted / got:.3f} |", flush=True)


if __name__ == "__main__":
    main()
