#!/usr/bin/env bash
# The expert-store figures of docs/BENCHMARKS.md: decode speed under budgets vs resident, no-cache and
# accelerate (each configuration in its own process), and hit rate by policy, live vs cache-sim.
# One thread per run; run it on a quiet machine (another process on the second core skews the
# prefetch figures most, since prefetching needs that core).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench-out/results
MOEKIT=.venv/bin/moekit
PY=.venv/bin/python

[ -d bench-out/ckpt/offload-2g ] || $PY benchmarks/make_offload_checkpoint.py   # ~2.2 GB, random bf16

$MOEKIT bench offload models/moekit-demo --expert-memory 12.5%,25%,50%,100% --vs accelerate --tokens 48 \
    --json-out bench-out/results/offload-demo.json
$MOEKIT bench offload bench-out/ckpt/offload-2g --expert-memory 12.5%,25%,50%,100% --vs accelerate --tokens 16 \
    --prompt-len 16 --json-out bench-out/results/offload-2g.json
$PY benchmarks/offload_policies.py models/moekit-demo --out bench-out/results/policies-demo.json
