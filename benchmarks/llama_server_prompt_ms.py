"""llama-server's own prompt evaluation time (`timings.prompt_ms` of its native /completion) for short
id prompts, one request at a time: what moekit's prefill graph (benchmarks/prefill_python_split.py's
`_fill_chunk`) is compared with. Start llama-server first, as the serving benches do:

  bench-out/llama.cpp/server-build/bin/llama-server -m bench-out/llama.cpp/gguf/qwen3_moe-150m-60ae9293-f32.gguf \
      --host 127.0.0.1 --port 8752 -np 16 -c 1152 -t 2 -tb 2 --no-warmup -cb
  python benchmarks/llama_server_prompt_ms.py --port 8752 [--tokens 8] [--requests 30]

Every prompt differs from the one before and `cache_prompt` is off, so each is evaluated whole.
"""

from __future__ import annotations

import argparse
import statistics

import httpx


def prompt(i: int, tokens: int) -> list[int]:
    """Request i's ids: distinct from its neighbours' (no prefix shared)."""
    return [(7 * i + j) % 997 + 3 for j in range(tokens)]


def prompt_ms(url: str, tokens: int, requests: int, warmup: int = 3) -> list[float]:
    """timings.prompt_ms of `requests` completions of 16 tokens, after `warmup` not counted."""
    found = []
    with httpx.Client(timeout=60) as client:
        for i in range(warmup + requests):
            body = {"prompt": prompt(i, tokens), "n_predict": 16, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
            timings = client.post(url, json=body).raise_for_status().json()["timings"]
            if timings["prompt_n"] != tokens:
                raise SystemExit(f"llama-server evaluated {timings['prompt_n']} prompt tokens, not {tokens}")
            if i >= warmup:
                found.append(timings["prompt_ms"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    found = prompt_ms(f"http://127.0.0.1:{args.port}/completion", args.tokens, args.requests)
    print(f"llama-server prompt_ms ({args.tokens} tokens): median {statistics.median(found):.2f}, "
          f"min {min(found):.2f}, max {max(found):.2f} (n {len(found)})")


if __name__ == "__main__":
    main()
