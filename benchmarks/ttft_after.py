"""TTFT at c = 1 by the length of the request before: one server (moekit serve, or llama-server with
--llama-server), 8-token id prompts sent one after another, max_tokens alternating 16 and 64 in a
fixed pattern, the TTFT medians by (the request before's max_tokens, its own). Finds costs a request
leaves for the next one (the benches send 64-token requests back to back). Start the server first:

  moekit serve bench-out/ckpt/qwen3_moe-150m --max-batch 16 --max-context 72 --threads 2 --port 8741
  python benchmarks/ttft_after.py --port 8741 [--pause 0.1]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import urllib.request

PATTERN = (16, 64, 64, 16, 16, 64)  # every (before, own) pair of the two lengths


def prompt_ids(i: int) -> list[int]:
    """Request i's 8 token ids, distinct from its neighbours' (no prefix shared)."""
    return [(7 * i + j) % 31000 + 3 for j in range(8)]


def first_token_ms(port: int, model: str, prompt: list[int], max_tokens: int) -> float:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    began, first = time.perf_counter(), None
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request) as reply:
        for line in reply:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - began
    return 1000 * first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=None, help="the model name to send (default: the server's first in /v1/models)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between requests")
    args = parser.parse_args()
    if args.model is None:
        with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models") as reply:
            args.model = json.load(reply)["data"][0]["id"]
    for i in range(3):
        first_token_ms(args.port, args.model, prompt_ids(i), 16)
    by_pair, before = collections.defaultdict(list), PATTERN[-1]
    for i, own in enumerate(PATTERN * args.rounds):
        time.sleep(args.pause)
        by_pair[(before, own)].append(first_token_ms(args.port, args.model, prompt_ids(1000 + i), own))
        before = own
    for (before, own), values in sorted(by_pair.items()):
        print(f"after {before:2d} tokens, own {own:2d}: TTFT median {statistics.median(values):.1f} ms (n {len(values)})")


if __name__ == "__main__":
    main()
