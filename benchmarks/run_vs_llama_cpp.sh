#!/usr/bin/env bash
# Batch-1 decode of moekit vs llama.cpp (llama-cpp-python 0.3.36) at equal precision, one run each:
#   float32 vs f32, bfloat16 vs bf16, moekit int8 weights (fp32 activations) vs q8_0.
#   benchmarks/build_llama_cpp.sh python                 # once (bench-out/llama.cpp, git-ignored)
#   benchmarks/run_vs_llama_cpp.sh [SIZES] [THREADS]      # default: 150m, 1 thread
# One JSON per run in bench-out/results/llama.cpp/, a line per run on stdout. Both sides see the
# same prompt ids, greedy, the same thread count; the GGUFs are made once by llama.cpp's converter.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
sizes="${1:-150m}" threads="${2:-1}" out=bench-out/results/llama.cpp
mkdir -p "$out" && .venv/bin/python benchmarks/make_checkpoints.py --sizes "${sizes// /,}"
for size in $sizes; do
    for family in qwen3_moe deepseek_v3; do
        for precision in float32:dtype bfloat16:dtype float32:int8; do
            dtype="${precision%%:*}"
            weights="${precision##*:}"
            name="$family-$size-$dtype-$weights-t$threads"
            echo "== $name ($(cut -d' ' -f1-3 /proc/loadavg) load)" >&2
            .venv/bin/moekit bench decode "bench-out/ckpt/$family-$size" --vs llama.cpp --dtype "$dtype" \
                --weights "$weights" --batch 1 --tokens 32 --repeats 3 --threads "$threads" --json > "$out/$name.json"
            .venv/bin/python -c "
import json, sys
d = json.load(open(sys.argv[1]))
for r in d['results']:
    print(f\"{sys.argv[2]:<40} moekit {r['moekit_tok_s']:7.1f} tok/s  llama.cpp {r['baseline_tok_s']:7.1f} tok/s  \"
          f\"ratio {r['ratio']:.2f}x  same tokens {r['same_tokens']}  threads {d['threads']}\")
" "$out/$name.json" "$name"
        done
    done
done
