"""The bundled demo model's figures as docs/DEMO_MODEL.md states them, derived here by hand from its
shape (qwen3_moe: 4 layers, D = 224, V = 4096 tied, 4 query heads and 1 KV head of 56, q/k RMSNorm,
128 experts of width 52, K = 2), not by the counter under test."""

from __future__ import annotations

from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "models" / "moekit-demo"

LAYERS, D, V, HEAD, E, K, F = 4, 224, 4096, 56, 128, 2, 52
ATTENTION = D * 4 * HEAD + 2 * D * 1 * HEAD + 4 * HEAD * D + 2 * HEAD  # q, k, v, o, q/k norms: 125,552
ALWAYS_ON_PER_LAYER = ATTENTION + 2 * D + D * E  # + the two layer norms + the router: 154,672
EXPERT = 3 * D * F  # gate, up, down: 34,944
EMBEDDING = V * D  # 917,504, the head tied to it
TOTAL_PARAMS = LAYERS * (ALWAYS_ON_PER_LAYER + E * EXPERT) + D + EMBEDDING
ACTIVE_PARAMS = LAYERS * (ALWAYS_ON_PER_LAYER + K * EXPERT) + D + EMBEDDING
assert (TOTAL_PARAMS, ACTIVE_PARAMS) == (19_427_744, 1_815_968)  # the figures the docs publish
ACTIVE_SHARE = ACTIVE_PARAMS / TOTAL_PARAMS  # 9.35%
