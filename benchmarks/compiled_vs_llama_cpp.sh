#!/usr/bin/env bash
# The compiled decode step (moekit --compile) and the eager one against llama.cpp, batch 1, at equal
# precision and thread count, then moekit's batch 8 against its own bandwidth roofline.
#   benchmarks/build_llama_cpp.sh python                   # once (bench-out/llama.cpp, git-ignored)
#   benchmarks/compiled_vs_llama_cpp.sh [THREADS] [SIZE]    # default: 2 threads, 150m
# One JSON per run in bench-out/results/compiled/, one line per run on stdout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
threads="${1:-2}" size="${2:-150m}" out=bench-out/results/compiled
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
for family in qwen3_moe deepseek_v3; do
    for dtype in float32 bfloat16; do
        for mode in compile eager; do
            flag=(); [ "$mode" = compile ] && flag=(--compile)
            name="$family-$size-$dtype-$mode-t$threads"
            echo "== $name ($(cut -d' ' -f1-3 /proc/loadavg) load)" >&2
            .venv/bin/moekit bench decode "bench-out/ckpt/$family-$size" --vs llama.cpp "${flag[@]}" --dtype "$dtype" \
                --batch 1 --tokens 32 --repeats 3 --threads "$threads" --json > "$out/$name.json"
            summary "$out/$name.json" "$name"
        done
        name="$family-$size-$dtype-compile-b8-t$threads"
        .venv/bin/moekit bench decode "bench-out/ckpt/$family-$size" --compile --dtype "$dtype" \
            --batch 1,8 --tokens 32 --repeats 3 --threads "$threads" --json > "$out/$name.json"
        summary "$out/$name.json" "$name"
    done
done
