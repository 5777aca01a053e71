"""`moekit bench offload`: decode speed under expert budgets, against named baselines, in one run.

moekit runs at every budget twice, without and with prefetch. Every configuration runs in its own child process (moekit.bench.offload_worker, or
moekit.bench.accelerate_baseline for transformers + accelerate), one after another, so each
peak RSS is that configuration's own and no run's page cache or threads help another's timing
more than the OS does. Baselines: the fully resident engine, moekit with no cache (every use
read from disk) at the smallest budget, and accelerate's disk offload at the same memory (dense
weights + the expert budget). No torch here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional

from moekit.bench.child import run_json_child


RSS_SLACK = 0.10  # the bound: peak RSS growth ≤ (dense + budget) × 1.10


@dataclass(frozen=True)
class OffloadBench:
    folder: str
    budgets: tuple[str, ...]
    policy: str
    prefetch_extra: int
    prompt_ids: tuple[int, ...]
    new_tokens: int
    threads: int
    dtype: str
    vs_accelerate: bool
    timeout_s: float = 1800.0


def _moekit(b: OffloadBench, budget: Optional[str], policy: str, prefetch: bool) -> list[str]:
    """The worker's command line; prefetch on adds the guessing (and its extra width)."""
    argv = [sys.executable, "-m", "moekit.bench.offload_worker", "--folder", b.folder,
            "--policy", policy, "--prompt-ids", ",".join(map(str, b.prompt_ids)),
            "--new-tokens", str(b.new_tokens), "--threads", str(b.threads), "--dtype", b.dtype]
    if budget is not None:
        argv += ["--expert-memory", budget]
    if prefetch:
        argv += ["--prefetch", "--prefetch-extra", str(b.prefetch_extra)]
    return argv


def run_bench(b: OffloadBench, minimum_budget: str, on_start: Callable[[str], None] = lambda _: None) -> dict:
    """Every configuration's result, keyed: resident, no-cache, moekit@<budget>, accelerate@<budget>."""
    results: dict[str, dict] = {}
    on_start("moekit fully resident")
    results["resident"] = run_json_child(_moekit(b, None, "lru", False), "the resident run", b.timeout_s)
    on_start(f"moekit, no cache, at {minimum_budget}")
    results["no-cache"] = run_json_child(_moekit(b, minimum_budget, "none", False), "the no-cache run", b.timeout_s)
    for budget in b.budgets:
        on_start(f"moekit {b.policy} at {budget}")
        ours = run_json_child(_moekit(b, budget, b.policy, False), f"moekit at {budget}", b.timeout_s)
        results[f"moekit@{budget}"] = ours
        if ours["budget_bytes"]:  # a budget that holds everything runs resident: nothing to guess
            on_start(f"moekit {b.policy} at {budget} with prefetch")
            results[f"prefetch@{budget}"] = run_json_child(_moekit(b, budget, b.policy, True),
                                                      f"moekit at {budget} with prefetch", b.timeout_s)
        if b.vs_accelerate:
            from moekit.bench.accelerate_baseline import child_command

            # The same memory: our resident weights plus the expert budget (at 100% that is the whole model).
            memory = ours["dense_bytes"] + ours["budget_bytes"]
            on_start(f"accelerate disk offload at {budget} ({memory / 1e6:.0f} MB)")
            argv = child_command(b.folder, memory, list(b.prompt_ids), b.new_tokens, b.threads, b.dtype)
            results[f"accelerate@{budget}"] = run_json_child(argv, f"accelerate at {budget}", b.timeout_s)
    return results


def rss_within_bound(result: dict) -> tuple[float, float, bool]:
    """(growth, bound, ok): peak RSS growth over the pre-load RSS vs (dense + budget) × 1.1."""
    growth = result["peak_rss_bytes"] - result["rss_before_load_bytes"]
    budget = result["budget_bytes"] or 0
    bound = (result["dense_bytes"] + budget) * (1 + RSS_SLACK)
    return growth, bound, growth <= bound


def summary_rows(b: OffloadBench, results: dict) -> list[dict]:
    resident, no_cache = results["resident"], results["no-cache"]
    rows = []
    for budget in b.budgets:
        ours = results[f"moekit@{budget}"]
        acc = results.get(f"accelerate@{budget}")
        guessed = results.get(f"prefetch@{budget}")
        report = ours["offload"] or {}
        decode = report.get("decode", {})
        guess = (guessed or {}).get("offload") or {}
        growth, bound, ok = rss_within_bound(ours)
        rows.append({
            "budget": budget,
            "tokens_per_s": ours["tokens_per_s"],
            "vs_resident": ours["tokens_per_s"] / resident["tokens_per_s"],
            "vs_no_cache": ours["tokens_per_s"] / no_cache["tokens_per_s"],
            "accelerate_tokens_per_s": acc["tokens_per_s"] if acc else None,
            "vs_accelerate": ours["tokens_per_s"] / acc["tokens_per_s"] if acc else None,
            "hit_rate": decode.get("hit_rate"),
            "prefetch_tokens_per_s": guessed["tokens_per_s"] if guessed else None,
            "prefetch_vs_resident": guessed["tokens_per_s"] / resident["tokens_per_s"] if guessed else None,
            "prefetch_hit_rate": guess.get("decode", {}).get("hit_rate"),
            "prefetch_recall": guess.get("prefetch_recall"),
            "prefetch_precision": guess.get("prefetch_precision"),
            "prefetch_disk_bytes_per_token": guess.get("decode", {}).get("disk_bytes_per_token"),
            "disk_bytes_per_token": decode.get("disk_bytes_per_token"),
            "stall_s_per_token": decode.get("stall_s_per_token"),
            "stall_share": decode.get("stall_share"),
            "rss_growth_bytes": growth,
            "rss_bound_bytes": bound,
            "rss_ok": ok,
            "accelerate_peak_rss_bytes": acc["peak_rss_bytes"] if acc else None,
            "same_tokens": ours["token_ids"] == resident["token_ids"]
            and (guessed is None or guessed["token_ids"] == resident["token_ids"]),
            "accelerate_same_tokens": None if acc is None else acc.get("token_ids") == resident["token_ids"],
        })
    return rows
