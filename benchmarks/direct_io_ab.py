"""The store's O_DIRECT reads (--direct-io) against plain pread, experts read cold.

    .venv/bin/python benchmarks/direct_io_ab.py CKPT --expert-memory 25% --rounds 2 --tokens 24

Before each run every file of CKPT is dropped from the page cache (posix_fadvise DONTNEED, as
benchmarks/read_ahead_ab.py does). Each run is one `moekit run CKPT --prompt-ids ... --json`
process; plain and direct alternate within a round (the machine is shared: compare within a
round). Prints prefill and decode tokens/s, the process's peak RSS, and the checkpoint's bytes in
the page cache after the run (`fincore`): what plain reads leave behind beside the store's own
copy, and O_DIRECT does not. Nothing here is imported by moekit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from read_ahead_ab import PROMPT, drop_from_page_cache

REPO = Path(__file__).resolve().parents[1]


def cached_bytes(folder: Path) -> int:
    """Bytes of folder's files now in the page cache (util-linux fincore)."""
    files = [str(p) for p in sorted(folder.rglob("*")) if p.is_file()]
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files], capture_output=True,
                         text=True, check=True).stdout
    return sum(int(line) for line in out.split())


def one_run(ckpt: Path, budget: str, direct: bool, tokens: int) -> dict:
    drop_from_page_cache(ckpt)
    cmd = [sys.executable, "-m", "moekit", "run", str(ckpt), "--prompt-ids", PROMPT, "--max-new-tokens", str(tokens),
           "--expert-memory", budget, "--json", *(["--direct-io"] if direct else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    if done.returncode != 0:
        raise SystemExit(f"direct {direct}: {done.stderr.strip()[-500:]}")
    out = json.loads(done.stdout)
    t, o = out["timing"], out["offload"]
    return {"direct_io": direct, "prefill_tok_s": t["prefill_tok_s"], "decode_tok_s": t["decode_tok_s"],
            "peak_rss_gib": o["peak_rss_bytes"] / 2**30, "page_cache_mib": cached_bytes(ckpt) / 2**20,
            "hit_rate": o["hit_rate"], "tokens": out["token_ids"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--expert-memory", default="25%")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    for r in range(args.rounds):
        up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        runs = [one_run(args.ckpt, args.expert_memory, direct, args.tokens) for direct in (False, True)]
        base, want = runs[0], runs[0]["tokens"]
        for run in runs:
            same = run.pop("tokens") == want
            ratio = {k: round(run[k] / base[k], 2) for k in ("prefill_tok_s", "decode_tok_s") if base[k]}
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in run.items()}
            print(json.dumps({"round": r, **shown, "vs_plain": ratio, "same_tokens": same, "uptime": up}), flush=True)


if __name__ == "__main__":
    main()
