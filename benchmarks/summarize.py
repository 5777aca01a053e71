"""Print the markdown table of docs/BENCHMARKS.md from the JSON files `moekit bench decode --json` wrote.

    .venv/bin/python benchmarks/summarize.py bench-out/results/*-t1.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: Path):
    run = json.loads(path.read_text())
    name = Path(run["checkpoint"]).name
    for r in run["results"]:
        yield (
            f"| {name} | {run['dtype']} | {r['batch']} | {r['moekit_tok_s']:.1f} | {r['baseline_tok_s']:.1f} "
            f"| {r['ratio']:.2f}× | {r['bytes_per_step'] / 1e6:.1f} | {r['roofline_tok_s']:.0f} "
            f"| {r['roofline_share']:.0%} | {'yes' if r['same_tokens'] else 'no'} | {run['tokens']}/{run['repeats']} "
            f"| {run['threads']} |"
        )


def main(paths: list[str]) -> None:
    print("| model | dtype | batch | moekit tok/s | baseline tok/s | ratio | MB read / step "
          "| roofline tok/s | share | same tokens | N / repeats | threads |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in sorted(paths):
        for line in rows(Path(p)):
            print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
