"""llama.cpp as a named baseline: `moekit bench decode CKPT --vs llama.cpp`, parent side (no torch).

The baseline is llama-cpp-python 0.3.36 built from its sdist by `benchmarks/build_llama_cpp.sh`
into a folder of its own (bench-out/llama.cpp/: its own venv, never a dependency of moekit's). The
GGUF is made from the same checkpoint by the converter that sdist vendors
(vendor/llama.cpp/convert_hf_to_gguf.py, with its own gguf-py), at the precision moekit runs:

    moekit dtype / weights    GGUF type
    float32                   f32
    bfloat16                  bf16
    int8 (every linear)       q8_0   (blocks of 32 inputs, one scale each: moekit's int8 layout)

One change to the converter's run, no change to what it writes for the weights: the benchmark
checkpoints' tokenizer is trained here, so its pre-tokenizer is none of the hashes the converter
knows and it would refuse; the run labels it "default" (decode is fed token ids, never text).

Each timed call is one child process (`moekit.bench.llama_cpp_worker` under the build's python,
with moekit's source on its path for the JSON protocol only): it loads the GGUF (memory-mapped,
so after the first call from the page cache), decodes greedily once untimed, then once timed. At
batch B the B prompt rows are B sequences of one llama context, each decode step one llama_decode
of B tokens, as moekit's decode step is one forward of B rows.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from moekit.bench.child import ChildCrashed, run_json_child
from moekit.errors import MoekitError

VERSION = "0.3.36"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0"}
BUILD_SCRIPT = "benchmarks/build_llama_cpp.sh"
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # src/: what the worker needs of moekit
DEFAULT_ROOT = SOURCE_ROOT.parent / "bench-out" / "llama.cpp"

# Runs the vendored converter as itself (its own argv, its own gguf-py); only the tokenizer's
# pre-tokenizer label is given, see the module docstring.
CONVERT = """
import sys
vendor = sys.argv[1]
sys.argv = [vendor + "/convert_hf_to_gguf.py", *sys.argv[2:]]
sys.path.insert(0, vendor)
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
convert_hf_to_gguf.main()
"""


def gguf_type(dtype: str, weights: str = "dtype") -> str:
    """The GGUF type that holds the weights at moekit's precision: f32, bf16 or q8_0."""
    if weights == "int8":
        return GGUF_TYPES["int8"]
    if weights != "dtype":
        raise MoekitError(f"--vs llama.cpp: no GGUF type matches --weights {weights} (f32, bf16 and q8_0 "
                          "quantize every linear alike; use --weights int8 or the dtype's own weights)")
    if dtype not in GGUF_TYPES:
        raise MoekitError(f"--vs llama.cpp: dtype must be float32 or bfloat16, got {dtype!r}")
    return GGUF_TYPES[dtype]


@dataclass(frozen=True)
class LlamaCppBuild:
    """Where build_llama_cpp.sh put everything."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def vendor(self) -> Path:
        return self.root / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"

    @property
    def server(self) -> Path:
        return self.root / "server-build" / "bin" / "llama-server"

    def gguf_path(self, folder: Path, outtype: str) -> Path:
        """<root>/gguf/<folder name>-<8 hex of its absolute path>-<type>.gguf: one per checkpoint and type."""
        folder = Path(folder).resolve()
        tag = hashlib.sha1(str(folder).encode()).hexdigest()[:8]
        return self.root / "gguf" / f"{folder.name}-{tag}-{outtype}.gguf"


def find_build(root: Optional[Path] = None) -> LlamaCppBuild:
    build = LlamaCppBuild(Path(root) if root is not None else DEFAULT_ROOT)
    missing = [p for p in (build.python, build.vendor / "convert_hf_to_gguf.py") if not p.exists()]
    if missing:
        raise MoekitError(f"--vs llama.cpp needs llama-cpp-python {VERSION} built in {build.root} "
                          f"(missing {missing[0]}): run {BUILD_SCRIPT} (5-15 minutes)")
    return build


def convert_command(build: LlamaCppBuild, folder: Path, outtype: str, outfile: Path) -> list[str]:
    """The converter under this python (it needs torch and transformers, which moekit's venv has)."""
    if outtype not in GGUF_TYPES.values():
        raise MoekitError(f"GGUF type must be one of {', '.join(GGUF_TYPES.values())}, got {outtype!r}")
    return [sys.executable, "-c", CONVERT, str(build.vendor), str(folder), "--outtype", outtype,
            "--outfile", str(outfile)]


def _newest_weight_mtime(folder: Path) -> float:
    files = [folder / "config.json", *folder.glob("*.safetensors"), *folder.glob("tokenizer*.json")]
    return max(f.stat().st_mtime for f in files if f.exists())


def ensure_gguf(build: LlamaCppBuild, folder: Path, outtype: str, timeout_s: float = 1800.0) -> Path:
    """The checkpoint as GGUF of `outtype`, converted once (again only if the checkpoint is newer)."""
    import subprocess

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise MoekitError(f"{folder}: llama.cpp's converter needs a tokenizer.json beside the weights "
                          "(benchmarks/make_checkpoints.py writes one)")
    out = build.gguf_path(folder, outtype)
    if out.is_file() and out.stat().st_mtime >= _newest_weight_mtime(folder):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    try:
        done = subprocess.run(convert_command(build, folder, outtype, partial), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise MoekitError(f"converting {folder} to GGUF {outtype} took over {timeout_s:.0f} s") from None
    if done.returncode != 0 or not partial.is_file():
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise MoekitError(f"llama.cpp's converter failed on {folder}: {lines[-1] if lines else done.returncode}")
    partial.replace(out)
    return out


Rows = tuple[tuple[int, ...], ...]  # [B, P] prompt ids


def prompt_rows(prompts) -> Rows:
    """The harness's [B, P] prompt tensor as a hashable tuple of B rows (no torch import here)."""
    return tuple(tuple(int(t) for t in row) for row in prompts.tolist())


def prompt_ids_arg(rows: Sequence[Sequence[int]]) -> str:
    """[[1, 2], [3, 4]] → '1,2;3,4': the worker's --prompt-ids, ';' between rows."""
    if not rows or not all(rows):
        raise MoekitError("no prompt ids given")
    if len({len(row) for row in rows}) != 1:
        raise MoekitError(f"prompt rows must be of one length (no padding), got {[len(row) for row in rows]}")
    return ";".join(",".join(str(int(t)) for t in row) for row in rows)


def worker_command(build: LlamaCppBuild, gguf: Path, rows: Sequence[Sequence[int]], new_tokens: int,
                   threads: int, warmup: int = 1, repack: bool = True) -> list[str]:
    ids = prompt_ids_arg(rows)
    if new_tokens < 2 or threads < 1 or warmup < 0:
        raise MoekitError("new tokens must be at least 2, threads at least 1, warm-up runs at least 0")
    return [str(build.python), "-m", "moekit.bench.llama_cpp_worker", "--gguf", str(gguf),
            "--prompt-ids", ids, "--new-tokens", str(int(new_tokens)),
            "--threads", str(int(threads)), "--warmup", str(int(warmup))] + ([] if repack else ["--no-repack"])


def worker_env() -> dict[str, str]:
    """The build's python finds moekit's source (the JSON protocol), and nothing else of ours."""
    return {**os.environ, "PYTHONPATH": str(SOURCE_ROOT)}


def token_rows(run: dict, batch: int) -> list[list[int]]:
    """The worker's token_ids, one list per prompt row ([B, N]); anything else is refused."""
    rows = run.get("token_ids")
    if not isinstance(rows, list) or len(rows) != batch or not all(isinstance(row, list) for row in rows):
        raise MoekitError(f"the llama.cpp baseline returned token_ids that are not {batch} rows")
    return [[int(t) for t in row] for row in rows]


def run_llama_cpp(build: LlamaCppBuild, gguf: Path, rows: Sequence[Sequence[int]], new_tokens: int, threads: int,
                  warmup: int = 1, timeout_s: float = 600.0, repack: bool = True) -> dict:
    """One child: tokens_per_s (decode, B x (N - 1) tokens), token_ids ([B, N]), prefill_s, decode_s, threads."""
    argv = worker_command(build, gguf, rows, new_tokens, threads, warmup, repack)
    return run_json_child(argv, "the llama.cpp baseline", timeout_s, env=worker_env())


class LlamaCppBaseline:
    """`--vs llama.cpp`: any batch, the same prompt rows and thread count, greedy, in child processes."""

    name = "llama.cpp"

    def __init__(self, build: LlamaCppBuild, gguf: Path, threads: int):
        self.build, self.gguf, self.threads = build, Path(gguf), threads
        self.last: dict[Rows, list[list[int]]] = {}  # prompt rows → [B, N] tokens of their latest timed run
        self.repack = True
        self.note: Optional[str] = None

    def _run(self, rows: Rows, new_tokens: int, warmup: int = 1) -> dict:
        """A run; if llama.cpp crashes with its weights repacked (its AMX q8_0 path segfaulted on one
        Intel machine here), this and every later run go without repacking, and info() says so."""
        try:
            return run_llama_cpp(self.build, self.gguf, rows, new_tokens, self.threads, warmup, repack=self.repack)
        except ChildCrashed as crash:
            if not self.repack:
                raise
            self.repack = False
            self.note = f"{crash} with its weights repacked; timed without repacking (use_extra_bufts off)"
            return run_llama_cpp(self.build, self.gguf, rows, new_tokens, self.threads, warmup, repack=False)

    def supports(self, batch: int) -> bool:
        return batch >= 1

    def timer(self, prompts, new_tokens: int) -> Callable[[], float]:
        rows = prompt_rows(prompts)

        def once() -> float:
            run = self._run(rows, new_tokens)
            self.last[rows] = token_rows(run, len(rows))
            return run["tokens_per_s"]

        return once

    def info(self) -> dict:
        return {"llama_cpp_python": VERSION, "gguf": str(self.gguf), "threads": self.threads, "repack": self.repack,
                "note": self.note}

    def tokens(self, prompts, new_tokens: int) -> list[list[int]]:
        rows = prompt_rows(prompts)
        if rows not in self.last:
            run = self._run(rows, new_tokens, warmup=0)
            self.last[rows] = token_rows(run, len(rows))
        return [row[:new_tokens] for row in self.last[rows]]
