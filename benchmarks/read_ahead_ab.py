"""The store's parallel reads (--read-ahead N) against the serial reference (0), experts read cold.

    .venv/bin/python benchmarks/read_ahead_ab.py CKPT --expert-memory 25% --read-ahead 0,2 --rounds 2

Before each run every file of CKPT is dropped from the page cache (posix_fadvise DONTNEED: only
these files, nothing else on the machine), so each miss is a read from the device, as on a model
larger than memory. Each run is one `moekit run CKPT --prompt-ids ... --json` process; the
settings alternate round by round (the machine is shared: compare within a round). Prints each
run's prefill and decode tokens/s, the store's stall seconds and hit rate, and per round the
ratio of each setting to the first. Nothing here is imported by moekit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "17,42,99,5,7,150,3,88,23,61,200,11,64,31,250,9"


def drop_from_page_cache(folder: Path) -> None:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_run(ckpt: Path, budget: str, read_ahead: int, tokens: int) -> dict:
    drop_from_page_cache(ckpt)
    cmd = [sys.executable, "-m", "moekit", "run", str(ckpt), "--prompt-ids", PROMPT, "--max-new-tokens", str(tokens),
           "--expert-memory", budget, "--read-ahead", str(read_ahead), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    if done.returncode != 0:
        raise SystemExit(f"read-ahead {read_ahead}: {done.stderr.strip()[-500:]}")
    out = json.loads(done.stdout)
    t, o = out["timing"], out["offload"]
    return {"read_ahead": read_ahead, "prefill_tok_s": t["prefill_tok_s"], "decode_tok_s": t["decode_tok_s"],
            "prefill_stall_s": o["prefill"]["stall_s"], "decode_stall_s_per_token": o["decode"]["stall_s_per_token"],
            "hit_rate": o["hit_rate"], "decode_disk_bytes_per_token": o["decode"]["disk_bytes_per_token"],
            "tokens": out["token_ids"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--expert-memory", default="25%")
    ap.add_argument("--read-ahead", default="0,2", help="comma-separated; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    settings = [int(x) for x in args.read_ahead.split(",")]
    for r in range(args.rounds):
        up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        runs = [one_run(args.ckpt, args.expert_memory, ra, args.tokens) for ra in settings]
        base, want = runs[0], runs[0]["tokens"]
        for run in runs:
            same = run.pop("tokens") == want
            ratio = {k: round(run[k] / base[k], 2) for k in ("prefill_tok_s", "decode_tok_s") if base[k]}
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in run.items()}
            print(json.dumps({"round": r, **shown, "vs_first": ratio, "same_tokens": same, "uptime": up}), flush=True)


if __name__ == "__main__":
    main()
