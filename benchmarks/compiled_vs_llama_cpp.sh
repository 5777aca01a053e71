#!/usr/bin/env bash
# The compiled decode step (moekit --compile) against llama.cpp at equal precision and thread count,
# batch 1 and 8, both ~150M benchmark shapes: fp32 vs f32, bf16 vs bf16, --weights int8 vs q8_0; each
# row also gives moekit's share of its bandwidth roofline. With EAGER as a third argument the eager
# step is run too (batch 1).
#   benchmarks/build_llama_cpp.sh python                   # once (bench-out/llama.cpp, git-ignored)
#   benchmarks/compiled_vs_llama_cpp.sh [THREADS] [SIZE] [eager]    # default: 2 threads, 150m
# One JSON per run in bench-out/results/compiled/, one line per batch on stdout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
threads="${1:-2}" size="${2:-150m}" eager="${3:-}" out=bench-out/results/compiled
batches=1,8; [ "$size" = 1b ] && batches=1
mkdir -p "$out" && .venv/bin/python benchmarks/make_checkpoints.py --sizes "$size" >/dev/null
summary() {
    .venv/bin/python -c "
import json, sys
d = json.load(open(sys.argv[1]))
for r in d['results']:
    base = f\"llama.cpp {r['baseline_tok_s']:7.1f} tok/s  ratio {r['ratio']:.2f}x  same tokens {r['same_tokens']}\" if r.get('baseline_tok_s') else ''
    share = r.get('roofline_share')
    print(f\"{sys.argv[2]:<44} batch {r['batch']}  moekit {r['moekit_tok_s']:7.1f} tok/s  {base}  roofline {share if share is None else round(100 * share)}%\")
" "$1" "$2"
}
run() {  # name, then bench decode's flags
    local name="$1"; shift
    echo "== $name ($(cut -d' ' -f1-3 /proc/loadavg) load)" >&2
    .venv/bin/moekit bench decode "$@" --vs llama.cpp --tokens 32 --repeats 3 --threads "$threads" --json > "$out/$name.json"
    summary "$out/$name.json" "$name"
}
for family in qwen3_moe deepseek_v3; do
    ckpt="bench-out/ckpt/$family-$size"
    for dtype in float32 bfloat16; do
        run "$family-$size-$dtype-compile-t$threads" "$ckpt" --compile --dtype "$dtype" --batch "$batches"
        if [ -n "$eager" ]; then run "$family-$size-$dtype-eager-t$threads" "$ckpt" --eager --dtype "$dtype" --batch 1; fi
    done
    if [ "$size" != 1b ]; then
        run "$family-$size-int8-compile-t$threads" "$ckpt" --compile --weights int8 --dtype float32 --batch "$batches"
    fi
done
