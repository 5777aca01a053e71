#!/usr/bin/env bash
# Decode speed of moekit vs transformers' generate on the checkpoints make_checkpoints.py wrote.
#   benchmarks/run_decode.sh [SIZES] [DTYPES] [THREADS]
#   benchmarks/run_decode.sh "10m 150m" "float32 bfloat16" 1
# One JSON per run in bench-out/results/, and the table on stdout. Both sides run in one process,
# on the same prompts, dtype and thread count; each number is the median of 3 runs after a warm-up.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
sizes="${1:-10m 150m}"
dtypes="${2:-float32 bfloat16}"
threads="${3:-1}"
tokens="${TOKENS:-32}"
out="$root/bench-out/results"
mkdir -p "$out"
cd "$root"
.venv/bin/python benchmarks/make_checkpoints.py --sizes "${sizes// /,}"
for size in $sizes; do
    for family in qwen3_moe deepseek_v3; do
        for dtype in $dtypes; do
            ckpt="bench-out/ckpt/$family-$size"
            name="$family-$size-$dtype-t$threads"
            echo "== $name" >&2
            .venv/bin/moekit bench decode "$ckpt" --vs transformers --dtype "$dtype" --batch 1,8 \
                --tokens "$tokens" --threads "$threads" --json > "$out/$name.json"
            .venv/bin/python -c "
import json, sys
d = json.load(open(sys.argv[1]))
for r in d['results']:
    print(f\"{sys.argv[2]:<32} batch {r['batch']}: moekit {r['moekit_tok_s']:8.1f} tok/s  {r['baseline']} {r['baseline_tok_s']:8.1f} tok/s  \"
          f\"ratio {r['ratio']:.2f}x  roofline {r['roofline_tok_s']:9.1f} tok/s  share {r['roofline_share']:.0%}  same tokens {r['same_tokens']}\")
" "$out/$name.json" "$name"
        done
    done
done
