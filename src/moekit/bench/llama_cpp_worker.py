"""One llama.cpp greedy decode of B prompts, in a child process under the llama.cpp build's python.

    bench-out/llama.cpp/venv/bin/python -m moekit.bench.llama_cpp_worker --gguf M.gguf \
        --prompt-ids "1,2,3;4,5,6" --new-tokens 32 --threads 1 --warmup 1

prints one JSON line; its token_ids are one list per prompt row (rows split by ';', all of one
length, as moekit's bench prompts are). It imports llama_cpp and numpy, and of moekit only the JSON
protocol (moekit.bench.child, no torch).

The B rows are B sequence ids in one llama context, decoded together through llama.cpp's own
batch API (llama_decode on a llama_batch): the prefill is one call of B x P tokens, then each of the
N - 1 timed decode steps is one call of B tokens, one per sequence, each asking for its logits.
Greedy is the argmax of each row's last logits, as moekit's greedy is; the first new token comes
from the prefill, so tokens_per_s = B x (N - 1) / decode seconds, as moekit's Timing counts.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

from moekit.bench.child import json_main, parse_ids
from moekit.errors import MoekitError

SLACK = 8  # context cells beyond prompt + new tokens per sequence, as the batch-1 worker always had
SEQ_CELLS_ROUND = 256  # llama.cpp rounds each sequence's cells up to a multiple of this


def parse_rows(text: str) -> list[list[int]]:
    """'1,2;3,4' → [[1, 2], [3, 4]]; '1,2' → [[1, 2]]. Rows must be non-empty and of one length."""
    rows = [parse_ids(row) for row in text.split(";") if row.strip()]
    if not rows or not all(rows):
        raise MoekitError(f"--prompt-ids needs at least one non-empty row, got {text!r}")
    if len({len(r) for r in rows}) != 1:
        raise MoekitError(f"--prompt-ids rows must be of one length (no padding), got {[len(r) for r in rows]}")
    return rows


def context_cells(batch: int, prompt_len: int, new_tokens: int) -> int:
    """n_ctx for B sequences. Without kv_unified, llama.cpp 0.3.36 gives each sequence
    n_ctx / n_seq_max cells rounded up to 256, so n_ctx holds all B of them, each already rounded
    (else llama.cpp rounds n_ctx itself and warns on stderr, whose last line is our error line)."""
    per_sequence = -(-(prompt_len + new_tokens + SLACK) // SEQ_CELLS_ROUND) * SEQ_CELLS_ROUND
    return batch * per_sequence


def batch_size(batch: int, prompt_len: int) -> int:
    """n_batch: the whole prefill (B x P tokens) in one llama_decode; at least 32 as before."""
    return max(32, batch * prompt_len)


def fill(batch, rows: list[list[int]], start: int) -> list[int]:
    """Write rows (row s → sequence s, positions start...) into a llama_batch, asking only for the
    logits of each row's last token; return those tokens' indices in the batch, one per row."""
    b = batch.batch
    n = 0
    last = []
    for seq, row in enumerate(rows):
        for i, token in enumerate(row):
            b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, start + i, 1, int(i == len(row) - 1)
            b.seq_id[n][0] = seq
            n += 1
        last.append(n - 1)
    b.n_tokens = n
    return last


def batched_greedy(llama_cpp, ctx, batch, n_vocab: int, rows: list[list[int]],
                   new_tokens: int) -> tuple[list[list[int]], float, float]:
    """([B, N] new token ids, prefill seconds, decode seconds) of one greedy run from an empty cache."""
    import numpy as np

    def step(inputs: list[list[int]], start: int) -> list[int]:
        outputs = fill(batch, inputs, start)
        ctx.decode(batch)
        return [int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, i), shape=(n_vocab,))))
                for i in outputs]

    prompt_len = len(rows[0])
    ctx.kv_cache_clear()
    start = time.perf_counter()
    out = [[t] for t in step(rows, 0)]  # [B, 1]
    prefilled = time.perf_counter()
    for k in range(new_tokens - 1):
        for row, t in zip(out, step([[row[-1]] for row in out], prompt_len + k)):
            row.append(t)
    return out, prefilled - start, time.perf_counter() - prefilled


def open_context(llama_cpp, gguf: str, batch: int, prompt_len: int, new_tokens: int, threads: int,
                 repack: bool = True):
    """(model, context, llama_batch) with the settings `llama_cpp.Llama(verbose=False)` uses (weights
    memory-mapped, CPU, no flash attention, f16 KV cache) and n_seq_max = B, one KV stream each.
    repack=False: no extra buffer types (llama.cpp's weight repacking, AMX's included)."""
    from llama_cpp import _internals
    from llama_cpp._logger import set_verbose

    if batch > llama_cpp.llama_max_parallel_sequences():
        raise MoekitError(f"llama.cpp decodes at most {llama_cpp.llama_max_parallel_sequences()} sequences "
                          f"in one context, asked for {batch}")
    set_verbose(False)
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    model_params.use_extra_bufts = repack
    model = _internals.LlamaModel(path_model=gguf, params=model_params, verbose=False)

    n_batch = batch_size(batch, prompt_len)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = context_cells(batch, prompt_len, new_tokens)
    params.n_batch, params.n_ubatch = n_batch, min(n_batch, 512)
    params.n_seq_max = batch
    params.kv_unified = False  # distinct prompts share no prefix: each attends over its own cells only
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.no_perf = False
    ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
    if llama_cpp.llama_n_ctx_seq(ctx.ctx) < prompt_len + new_tokens:
        raise MoekitError(f"llama.cpp gave each sequence {llama_cpp.llama_n_ctx_seq(ctx.ctx)} cells, "
                          f"fewer than {prompt_len + new_tokens}")
    cells = _internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=False)
    return model, ctx, cells


def run(gguf: str, rows: list[list[int]], new_tokens: int, threads: int, warmup: int, repack: bool = True) -> dict:
    try:
        import llama_cpp
    except ImportError:
        raise MoekitError(f"llama_cpp is not importable by {sys.executable}: run benchmarks/build_llama_cpp.sh") from None
    model, ctx, batch = open_context(llama_cpp, gguf, len(rows), len(rows[0]), new_tokens, threads, repack)
    n_vocab = model.n_vocab()
    for _ in range(warmup):
        batched_greedy(llama_cpp, ctx, batch, n_vocab, rows, new_tokens)
    tokens, prefill_s, decode_s = batched_greedy(llama_cpp, ctx, batch, n_vocab, rows, new_tokens)
    return {
        "tokens_per_s": len(rows) * (new_tokens - 1) / decode_s if decode_s > 0 else float("nan"),
        "token_ids": tokens,  # [B, N], also at B = 1
        "batch": len(rows),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "threads": threads,
        "repack": repack,
        "gguf": gguf,
        "llama_cpp_python": llama_cpp.__version__,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moekit.bench.llama_cpp_worker",
                                     description="One greedy llama.cpp decode of B prompts; prints one JSON line.")
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompt-ids", required=True, help="token ids, ',' between ids, ';' between rows")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-repack", action="store_true", help="no weight repacking (llama.cpp's extra buffer types)")
    args = parser.parse_args(argv)
    return json_main(lambda: run(args.gguf, parse_rows(args.prompt_ids), args.new_tokens, args.threads, args.warmup,
                                 not args.no_repack))


if __name__ == "__main__":
    sys.exit(main())
