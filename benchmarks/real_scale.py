"""moekit against llama.cpp on one GGUF at real size, each engine in its own process, runs alternated.

    .venv/bin/python benchmarks/real_scale.py FILE.gguf --moekit "--expert-memory 10GiB" --rounds 2 --tokens 16
    .venv/bin/python benchmarks/real_scale.py FILE.gguf --moekit "" --rounds 2      # resident (gpt-oss)

Per run: load seconds, prefill and decode tokens/s (greedy, the same 16 prompt ids), peak RSS
(VmHWM: for llama.cpp's mmap it counts the file pages it touched), bytes read from the block device
per decoded token (/proc/self/io read_bytes: page-cache hits are not counted, for either engine) and,
for moekit's store, the hit rate. llama.cpp runs through llama-cpp-python (the binding
benchmarks/build_llama_cpp.sh builds; default mmap, its page cache its only expert cache) with
n_threads = moekit's threads. `uptime` is printed before each run: the machine is shared.
Nothing here is imported by moekit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA_PY = Path("/work/main/bench-out/llama.cpp/venv/bin/python")
PROMPT = [17, 42, 99, 5, 7, 150, 3, 88, 23, 61, 200, 11, 64, 31, 250, 9]


def _io_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def child_moekit(path: str, tokens: int, threads: int, options: list[str], prompt: list[int]) -> dict:
    import torch

    from moekit.engine.loader import load_engine
    from moekit.offload.options import OffloadOptions

    torch.set_num_threads(threads)
    opts = dict(zip(options[::2], options[1::2]))
    offload = (OffloadOptions(opts["--expert-memory"], policy=opts.get("--cache", "lru"))
               if "--expert-memory" in opts else None)
    t0 = time.perf_counter()
    engine = load_engine(Path(path), dtype=opts.get("--dtype", "bfloat16"), offload=offload)
    load_s = time.perf_counter() - t0
    print(f"moekit loaded in {load_s:.0f} s, RSS {_hwm() / 2**30:.1f} GiB", file=sys.stderr, flush=True)
    before = _io_read()
    gen = engine.generate([prompt], max_new_tokens=tokens, stop_ids=())
    read = _io_read() - before
    t = gen.timing
    out = {"engine": "moekit", "load_s": load_s, "prefill_tok_s": len(prompt) / t.prefill_s,
           "decode_tok_s": t.decode_steps / t.decode_s, "tokens": gen.token_ids[0],
           "read_bytes_per_token": read / (tokens + 1), "peak_rss": _hwm(), "notes": list(engine.notes)}
    if engine.store is not None:
        st = engine.store.stats()
        out.update(hit_rate=st["hit_rate"], decode_hit_rate=st["decode_hit_rate"],
                   store_disk_bytes_per_token=st["disk_bytes"] / (tokens + 1), slots_per_layer=st["slots_per_layer"])
    return out


def child_llama(path: str, tokens: int, threads: int, prompt: list[int]) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=256, n_batch=64, n_threads=threads, n_threads_batch=threads,
                use_mmap=True, verbose=False)
    load_s = time.perf_counter() - t0
    before = _io_read()
    out_ids, stamps = [], [time.perf_counter()]
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # greedy; the first yield ends the prefill
        out_ids.append(int(tok))
        stamps.append(time.perf_counter())
        if len(out_ids) == tokens:
            break
    prefill_s, decode_s = stamps[1] - stamps[0], stamps[-1] - stamps[1]
    read = _io_read() - before
    return {"engine": "llama.cpp", "load_s": load_s, "prefill_tok_s": len(prompt) / prefill_s,
            "decode_tok_s": (tokens - 1) / decode_s, "tokens": out_ids,
            "read_bytes_per_token": read / tokens, "peak_rss": _hwm()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--moekit", default="--expert-memory 10GiB", help="moekit's options (empty: resident)")
    ap.add_argument("--moekit-path", help="moekit reads this instead (e.g. the mxfp4 safetensors of the same weights)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=len(PROMPT), help="the first N of the 16 prompt ids")
    ap.add_argument("--only", choices=("moekit", "llama.cpp"))
    ap.add_argument("--child", choices=("moekit", "llama.cpp"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    prompt = PROMPT[: args.prompt_len]
    if args.child == "moekit":
        print(json.dumps(child_moekit(args.moekit_path or args.gguf, args.tokens, args.threads, shlex.split(args.moekit),
                                      prompt)))
        return
    if args.child == "llama.cpp":
        print(json.dumps(child_llama(args.gguf, args.tokens, args.threads, prompt)))
        return
    runs = []
    engines = [e for e in ("llama.cpp", "moekit") if args.only in (None, e)]
    for r in range(args.rounds):
        for engine in engines:
            python = str(LLAMA_PY) if engine == "llama.cpp" else sys.executable
            cmd = [python, __file__, args.gguf, "--child", engine, "--tokens", str(args.tokens),
                   "--threads", str(args.threads), "--moekit", args.moekit, "--prompt-len", str(args.prompt_len)]
            if args.moekit_path:
                cmd += ["--moekit-path", args.moekit_path]
            up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
            env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)  # stderr: progress, shown
            if done.returncode != 0:
                print(f"round {r} {engine}: failed ({done.returncode})\n(its stderr is above)", flush=True)
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1]) | {"round": r, "uptime": up}
            runs.append(result)
            shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items() if k not in ("tokens", "notes")}
            print(json.dumps(shown), flush=True)
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
