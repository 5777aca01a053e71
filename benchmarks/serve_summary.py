"""Markdown tables from benchmarks/serve_bench.py's JSON: one row per side × concurrency.

  .venv/bin/python benchmarks/serve_summary.py bench-out/serve-demo.json bench-out/serve-150m.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ms(value: float) -> str:
    return "—" if value != value else f"{value * 1000:.0f}"


def table(report: dict) -> str:
    lines = [
        f"`{report['checkpoint']}` · prompts of {report['prompt_len']} random ids · {report['max_tokens']} output tokens "
        f"per request · max batch / -np {report['max_batch']} · {report['threads']} thread(s)",
        "",
        "| dtype | side | c | output tok/s | × c=1 | × llama-server | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | ITL p99 / p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, runs in report["runs"].items():
        llama = {lvl["concurrency"]: lvl["output_tok_s"] for lvl in runs.get("llama-server", [])}
        for side, levels in runs.items():
            base = levels[0]["output_tok_s"] if levels else float("nan")
            for lvl in levels:
                c, tps = lvl["concurrency"], lvl["output_tok_s"]
                vs = f"{tps / llama[c]:.2f}×" if c in llama and side != "llama-server" else "—"
                ttft = "/".join(ms(lvl["ttft_s"][k]) for k in ("p50", "p90", "p99")) if "ttft_s" in lvl else "—"
                itl = "/".join(ms(lvl["itl_s"][k]) for k in ("p50", "p90", "p99")) if "itl_s" in lvl else "—"
                ratio = f"{lvl['itl_s']['p99'] / lvl['itl_s']['p50']:.2f}" if "itl_s" in lvl else "—"
                lines.append(f"| {dtype} | {side} | {c} | {tps:.1f} | {tps / base:.2f}× | {vs} | {ttft} | {itl} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    for path in sys.argv[1:]:
        print(table(json.loads(Path(path).read_text())))
        print()


if __name__ == "__main__":
    main()
