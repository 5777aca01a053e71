"""One llama.cpp greedy decode at batch 1, in a child process under the llama.cpp build's python.

    bench-out/llama.cpp/venv/bin/python -m moekit.bench.llama_cpp_worker --gguf M.gguf \
        --prompt-ids 1,2,3 --new-tokens 32 --threads 1 --warmup 1

prints one JSON line. It imports llama_cpp and numpy, and of moekit only the JSON protocol
(moekit.bench.child, no torch). Greedy is the argmax of the last position's logits after each
`eval`, as moekit's greedy is; the first new token comes from the prefill, then N - 1 decode steps
are timed: tokens_per_s = (N - 1) / their seconds, as moekit's Timing counts.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

from moekit.bench.child import json_main, parse_ids
from moekit.errors import MoekitError


def greedy(llm, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """(new token ids, prefill seconds, decode seconds) of one greedy run from an empty cache."""
    import numpy as np

    n_vocab = llm.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))  # the last position's
        return int(np.argmax(logits))

    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt_ids)
    out = [next_token()]
    prefilled = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([out[-1]])
        out.append(next_token())
    return out, prefilled - start, time.perf_counter() - prefilled


def run(gguf: str, prompt_ids: list[int], new_tokens: int, threads: int, warmup: int) -> dict:
    try:
        import llama_cpp
    except ImportError:
        raise MoekitError(f"llama_cpp is not importable by {sys.executable}: run benchmarks/build_llama_cpp.sh") from None
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(prompt_ids) + new_tokens + 8, n_batch=max(32, len(prompt_ids)),
                          n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    for _ in range(warmup):
        greedy(llm, prompt_ids, new_tokens)
    tokens, prefill_s, decode_s = greedy(llm, prompt_ids, new_tokens)
    return {
        "tokens_per_s": (new_tokens - 1) / decode_s if decode_s > 0 else float("nan"),
        "token_ids": tokens,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "threads": threads,
        "gguf": gguf,
        "llama_cpp_python": llama_cpp.__version__,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moekit.bench.llama_cpp_worker",
                                     description="One greedy llama.cpp decode at batch 1; prints one JSON line.")
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompt-ids", required=True)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    return json_main(lambda: run(args.gguf, parse_ids(args.prompt_ids), args.new_tokens, args.threads, args.warmup))


if __name__ == "__main__":
    sys.exit(main())
