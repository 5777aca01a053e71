"""moekit against llama.cpp on one GGUF at real size, each engine in its own process, runs alternated.

    .venv/bin/python benchmarks/real_scale.py FILE.gguf --moekit "--expert-memory 10GiB" --rounds 2 --tokens 16
    .venv/bin/python benchmarks/real_scale.py FILE.gguf --moekit "" --rounds 2      # resident (gpt-oss), compiled step
    .venv/bin/python benchmarks/real_scale.py FILE.gguf --moekit=--eager --rounds 2     # the eager step

Per run: load seconds, prefill and decode tokens/s (greedy, the same 16 prompt ids; moekit after one
untimed run of the prompt and 2 tokens, in which a compiled step compiles or loads its graph), peak RSS
(VmHWM: for llama.cpp's mmap it counts the file pages it touched), bytes read from the block device
per decoded token (/proc/self/io read_bytes: page-cache hits are not counted, for either engine) and,
for moekit's store, the hit rates (cumulative, and the timed run's decode alone) and its reads; for
moekit also where its memory went: RssAnon, RssFile, the store's bytes and glibc's heap, sampled
every 5 ms through each phase (moekit.bench.offload_rss). llama.cpp runs as its own `llama-bench` binary (built by
benchmarks/build_llama_cpp.sh) with -p PROMPT -n TOKENS -t THREADS -r 1 (its warm-up included,
as it does by default), under /usr/bin/time for its peak RSS and file-system reads; --llama-args
adds its options (a larger-than-memory run wants `--repack 0 -lm mmap`: repacking copies every
weight into anonymous memory). `uptime` is printed before each run: the machine is shared.
A random-weight checkpoint's tokens route nearly alike (its hidden states share one direction) and
repeat one greedy token; for the hit rate a user's text would see, moekit's side takes
`--route-noise σ` (moekit's gumbel:σ:seed routing policy: each token's experts drawn on their own),
`--route-skew S` (Zipf-like router biases, benchmarks/skewed_routing.py) and `--temperature T`
(sampled tokens). llama.cpp's side stays greedy and exact.
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
LLAMA_BENCH = REPO / "bench-out" / "llama.cpp" / "server-build" / "bin" / "llama-bench"
PROMPT = [17, 42, 99, 5, 7, 150, 3, 88, 23, 61, 200, 11, 64, 31, 250, 9]


def prompt_ids(n: int) -> list[int]:
    """The first n ids of PROMPT, continued by a fixed stride past 16 (byte tokens of the
    writer's vocabulary, as PROMPT's are)."""
    return [PROMPT[i] if i < len(PROMPT) else (37 * i + 11) % 256 for i in range(n)]


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


def moekit_options(words: list[str]) -> dict[str, str]:
    """`moekit run`'s options as given to --moekit: "--flag value" pairs, and bare flags
    (--direct-io) as "" values."""
    opts, i = {}, 0
    while i < len(words):
        takes = i + 1 < len(words) and not words[i + 1].startswith("--")
        opts[words[i]] = words[i + 1] if takes else ""
        i += 2 if takes else 1
    return opts


def child_moekit(path: str, tokens: int, threads: int, options: list[str], prompt: list[int], skew: float = 0.0,
                 temperature: float = 0.0, seed: int = 0, noise: float = 0.0) -> dict:
    import torch

    from moekit.bench.offload_rss import RssSampler

    torch.set_num_threads(threads)
    held: dict = {}  # the engine once loaded: the sampler's probes read its store
    sampler = RssSampler(probes={"store_bytes": lambda: held["engine"].store.clock.resident_bytes})
    with sampler:
        out = _moekit_run(path, tokens, options, prompt, skew, temperature, seed, noise, sampler, held)
    out["rss"] = sampler.report()
    out["peak_rss"] = out["rss"]["vm_hwm"]
    return out


def _moekit_run(path: str, tokens: int, options: list[str], prompt: list[int], skew: float, temperature: float,
                seed: int, noise: float, sampler, held: dict) -> dict:
    from moekit.bench.offload_worker import resident_bytes
    from moekit.engine.sampling import SamplingParams
    from moekit.engine.loader import load_engine
    from moekit.offload.options import OffloadOptions
    from moekit.offload.report import offload_report

    sampler.mark("started")
    opts = moekit_options(options)
    offload = (OffloadOptions(opts["--expert-memory"], policy=opts.get("--cache", "lru"),
                              read_ahead=int(opts.get("--read-ahead", 2)),
                              split=Path(opts["--expert-split"]) if "--expert-split" in opts else None,
                              direct_io="--direct-io" in opts)
               if "--expert-memory" in opts else None)
    t0 = time.perf_counter()
    # compile None: moekit's default (the compiled decode step where the model allows it), as `moekit run`.
    engine = load_engine(Path(path), dtype=opts.get("--dtype", "bfloat16"), offload=offload,
                         compile=False if "--eager" in opts else None, kernels=opts.get("--kernels", "auto"),
                         weights=opts.get("--weights", "dtype"))
    load_s = time.perf_counter() - t0
    held["engine"] = engine
    sampler.mark("loaded")
    print(f"moekit loaded in {load_s:.0f} s, RSS {_hwm() / 2**30:.1f} GiB", file=sys.stderr, flush=True)
    if skew:
        from skewed_routing import skew_routers

        skew_routers(engine.decoder, skew)
    sampling = SamplingParams(temperature=temperature, seed=seed) if temperature > 0 else SamplingParams()
    policy = warm_policy = None
    if noise:
        # moekit's own routing policy gumbel:σ:seed: top-K on logits + σ·Gumbel noise is a draw per
        # token from softmax(logits / σ), so each token routes independently of the one before.
        from moekit.model.routing import parse_policy

        router = engine.spec.layers[engine.spec.moe_layers[0]].ffn.router
        policy = parse_policy(f"gumbel:{noise:g}:{seed}", router.top_k, router.num_experts)
        warm_policy = parse_policy(f"gumbel:{noise:g}:{seed + 1}", router.top_k, router.num_experts)  # other draws
    # One untimed run first, as llama-bench warms up: the compiled step compiles (or loads) its graph
    # on its first step, which is start-up, not decoding. It routes as the timed run does (a routing
    # policy is a graph of its own), with its own noise, so it does not load the timed run's draws.
    engine.generate([prompt], max_new_tokens=2, stop_ids=(), sampling=sampling, policy=warm_policy)
    sampler.mark("warmed")
    store = engine.store
    warmed = store.stats() if store is not None else None
    after_prompt: dict = {}  # the store's figures once the timed run's prompt pass is done

    def on_token(step, ids):
        if step == 0 and store is not None:
            after_prompt.update(store.stats())

    before = _io_read()
    gen = engine.generate([prompt], max_new_tokens=tokens, stop_ids=(), sampling=sampling, policy=policy,
                          on_token=on_token)
    read = _io_read() - before
    sampler.mark("generated")
    t = gen.timing
    acts = engine.meter(gen)[1:]  # the decoded tokens (the first comes from the prompt pass)
    out = {"engine": "moekit", "bytes_touched_per_token": sum(a.bytes_touched for a in acts) / max(1, len(acts)),
           "active_share": sum(a.share for a in acts) / max(1, len(acts)), "load_s": load_s, "prefill_tok_s": len(prompt) / t.prefill_s,
           "decode_tok_s": t.decode_steps / t.decode_s, "tokens": gen.token_ids[0],
           "read_bytes_per_token": read / (tokens + 1), "peak_rss": _hwm(), "notes": list(engine.notes),
           "route_skew": skew, "route_noise": noise, "temperature": temperature,
           "compiled": engine.decoder.compiled is not None, "dense_bytes": resident_bytes(engine.decoder)}
    if store is not None:
        st = store.stats()
        # The timed run's own figures: the warm-up's loads and hits left out, its decode from the
        # prompt pass on (cumulative hit_rate / decode_hit_rate kept beside them).
        timed = offload_report(after_prompt, st, t.decode_steps, t.decode_s)
        out.update(hit_rate=st["hit_rate"], decode_hit_rate=st["decode_hit_rate"],
                   timed_decode_hit_rate=timed["decode_hit_rate"],
                   store_disk_bytes_per_token=(st["disk_bytes"] - warmed["disk_bytes"]) / (tokens + 1),
                   store_decode_disk_bytes_per_token=timed["decode"]["disk_bytes_per_token"],
                   slots_per_layer=st["slots_per_layer"],
                   budget_bytes=st["budget_bytes"], peak_resident_expert_bytes=st["peak_resident_expert_bytes"],
                   peak_held_expert_bytes=st["peak_held_expert_bytes"])
    return out


def run_llama_bench(path: str, prompt_len: int, tokens: int, threads: int, extra: list[str]) -> dict:
    """One llama-bench run: prefill (-p) and decode (-n) tokens/s, peak RSS, bytes read."""
    if not LLAMA_BENCH.is_file():
        raise SystemExit(f"{LLAMA_BENCH} not found: build it with benchmarks/build_llama_cpp.sh (or pass --only moekit)")
    cmd = ["/usr/bin/time", "-f", "TIME %M %I %e", str(LLAMA_BENCH), "-m", path, "-p", str(prompt_len), "-n", str(tokens),
           "-t", str(threads), "-r", "1", "-o", "json", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    timeline = [line for line in done.stderr.splitlines() if line.startswith("TIME ")]
    if done.returncode != 0 or not timeline:
        raise SystemExit(f"llama-bench failed ({done.returncode}): {done.stderr[-2000:]}")
    rss_kb, inputs, wall = timeline[-1].split()[1:]
    tests = json.loads(done.stdout)
    rate = {("prefill" if t["n_prompt"] else "decode"): t["avg_ts"] for t in tests}
    return {"engine": "llama.cpp (llama-bench)", "args": extra, "prefill_tok_s": rate.get("prefill"),
            "decode_tok_s": rate.get("decode"), "peak_rss": int(rss_kb) * 1024, "wall_s": float(wall),
            # %I: file-system inputs in 512-byte units, over the whole run (load, warm-up, both tests)
            "read_bytes_per_token": int(inputs) * 512 / (prompt_len + tokens)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--moekit", default="--expert-memory 10GiB", help="moekit's options (empty: resident); one starting with -- as --moekit=--eager")
    ap.add_argument("--moekit-path", help="moekit reads this instead (e.g. the mxfp4 safetensors of the same weights)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=len(PROMPT), help="prompt ids (prompt_ids)")
    ap.add_argument("--llama-args", default="", help="llama-bench's extra options, e.g. '--repack 0 -lm mmap'")
    ap.add_argument("--only", choices=("moekit", "llama.cpp"))
    ap.add_argument("--route-skew", type=float, default=0.0,
                    help="moekit side: add a Zipf-like logit bias of exponent S to every router (benchmarks/skewed_routing.py)")
    ap.add_argument("--temperature", type=float, default=0.0, help="moekit side: sample at T (seeded) instead of greedy")
    ap.add_argument("--route-noise", type=float, default=0.0,
                    help="moekit side: route with moekit's gumbel:σ:seed policy (each token drawn on its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", choices=("moekit",), help=argparse.SUPPRESS)
    args = ap.parse_args()
    prompt = prompt_ids(args.prompt_len)
    if args.child == "moekit":
        print(json.dumps(child_moekit(args.moekit_path or args.gguf, args.tokens, args.threads, shlex.split(args.moekit),
                                      prompt, args.route_skew, args.temperature, args.seed, args.route_noise)))
        return
    runs = []
    engines = [e for e in ("llama.cpp", "moekit") if args.only in (None, e)]
    for r in range(args.rounds):
        for engine in engines:
            up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
            if engine == "llama.cpp":
                result = run_llama_bench(args.gguf, args.prompt_len, args.tokens, args.threads, shlex.split(args.llama_args))
                runs.append(result | {"round": r, "uptime": up})
                print(json.dumps(runs[-1]), flush=True)
                continue
            cmd = [sys.executable, __file__, args.gguf, "--child", engine, "--tokens", str(args.tokens),
                   "--threads", str(args.threads), f"--moekit={args.moekit}", "--prompt-len", str(args.prompt_len),
                   "--route-skew", str(args.route_skew), "--temperature", str(args.temperature), "--seed", str(args.seed),
                   "--route-noise", str(args.route_noise)]
            if args.moekit_path:
                cmd += ["--moekit-path", args.moekit_path]
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
