"""TTFT at c = 1 by the length of the request before: one server (moekit serve, or llama-server),
8-token id prompts sent one after another, max_tokens alternating 16 and 64 in a fixed pattern, the
TTFT medians by (the request before's max_tokens, its own). Finds costs a request leaves for the
next one (the benches send 64-token requests back to back). The requests are the benches' own
(moekit.bench.serve.one_request). Start the server first:

  moekit serve bench-out/ckpt/qwen3_moe-150m --max-batch 16 --max-context 72 --threads 2 --port 8741
  python benchmarks/ttft_after.py --port 8741 [--pause 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics

import httpx

from moekit.bench.serve import first_model, one_request

PATTERN = (16, 64, 64, 16, 16, 64)  # every (before, own) pair of the two lengths


def body(model: str, i: int, max_tokens: int) -> dict:
    """Request i: 8 token ids distinct from its neighbours' (no prefix shared), greedy, max_tokens long."""
    return {"model": model, "prompt": [(7 * i + j) % 31000 + 3 for j in range(8)], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}


async def by_pair(url: str, model: str, rounds: int, pause: float) -> dict:
    """{(before, own): [TTFT ms]} over `rounds` of PATTERN, after 3 warm-up requests."""
    found, before = collections.defaultdict(list), PATTERN[-1]
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(3):
            await one_request(client, url, body(model, i, 16))
        for i, own in enumerate(PATTERN * rounds):
            await asyncio.sleep(pause)
            result = await one_request(client, url, body(model, 1000 + i, own))
            if not result.ok:
                raise SystemExit(f"request {i}: {result.error}")
            found[(before, own)].append(1000 * result.ttft_s)
            before = own
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=None, help="the model name to send (default: the server's first in /v1/models)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between requests")
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}/v1"
    model = args.model or first_model(base)
    found = asyncio.run(by_pair(base + "/completions", model, args.rounds, args.pause))
    for (before, own), values in sorted(found.items()):
        print(f"after {before:2d} tokens, own {own:2d}: TTFT median {statistics.median(values):.1f} ms (n {len(values)})")


if __name__ == "__main__":
    main()
