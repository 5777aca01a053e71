"""The terminal tables of `moekit analyze` (rich); the figures come from moekit.analysis."""

from __future__ import annotations


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _table(title: str, head: list[str]):
    from rich.table import Table

    table = Table(title=title)
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i == 0 else "right")
    return table


def verdict_caption(layers: dict) -> str:
    """Under the load table: why a layer has no verdict, or what the verdicts mean."""
    from moekit.analysis.load_stats import TOO_FEW, VERDICT_MEANINGS, VERDICT_TOKENS_PER_EXPERT

    short = {l: s for l, s in layers.items() if s["verdict"] == TOO_FEW}
    lines = [f"layer {l}: too few tokens for a verdict (n={s['tokens']:,}; need ≥ {VERDICT_TOKENS_PER_EXPERT} × "
             f"{s['experts']} experts = {s['verdict_min_tokens']:,}): the numbers only" for l, s in short.items()]
    if len(short) == len(layers) and len({(s["tokens"], s["verdict_min_tokens"]) for s in short.values()}) == 1:
        s = next(iter(short.values()))
        lines = [f"too few tokens for a verdict (n={s['tokens']:,}; need ≥ {VERDICT_TOKENS_PER_EXPERT} × "
                 f"{s['experts']} experts = {s['verdict_min_tokens']:,} per layer): the numbers only"]
    if len(short) < len(layers):
        lines.append(VERDICT_MEANINGS)
    return "\n".join(lines)


def print_tables(console, stats: dict) -> None:
    model = stats["model"]["model"] if stats["model"] else "model unknown"
    load = _table(f"{stats['trace']} ({model}): {stats['entries']:,} token × layer entries · expert load",
                  ["layer", "experts", "max/mean", "CV", "hottest 10%", "unused", "load entropy (bits)", "verdict"])
    health = _table("router health and reuse", ["layer", "weight entropy (bits)", "top-1 share", "top-1 ≥ 0.85",
                                                "same experts as previous token", "overlap with previous"])
    for l, s in stats["layers"].items():
        load.add_row(l, str(s["experts"]), f"{s['max_over_mean']:.2f}", f"{s['cv']:.2f}", _pct(s["hot10_share"]),
                     str(s["unused"]), f"{s['load_entropy_bits']:.2f} of {s['load_entropy_max_bits']:.2f}", s["verdict"])
        health.add_row(l, f"{s['weight_entropy_bits']:.2f}", _pct(s["top1_share_mean"]), _pct(s["top1_confident_share"]),
                       _pct(stats["reuse"][l]["same_experts"]), _pct(stats["reuse"][l]["overlap"]))
    load.caption, load.caption_justify = verdict_caption(stats["layers"]), "left"
    console.print(load)
    console.print(health)

    act = stats["activation"]
    dist = _table(f"activation per token (share of {act['share_of']})",
                  ["tokens", "count", "mean", "p5", "p50", "p95", "min", "max", "experts/token"])
    groups = [("all", act["share"], act["experts_per_token"])]
    groups += [(f"domain {d}", v, None) for d, v in act["by_domain"].items() if len(act["by_domain"]) > 1]
    groups += [(f"position {p}", v, None) for p, v in act["by_position"].items()]
    for name, v, experts in groups:
        dist.add_row(name, f"{v['tokens']:,}", *(f"{v[k]:.2%}" for k in ("mean", "p5", "p50", "p95", "min", "max")),
                     "-" if experts is None else f"{experts['mean']:.2f}")
    console.print(dist)

    spec = stats["specialisation"]
    if len(spec["domains"]) > 1:
        div = _table("expert-usage divergence between domains (Jensen–Shannon, bits, mean over layers)",
                     ["", *spec["domains"]])
        for a in spec["domains"]:
            div.add_row(a, *(f"{spec['js_bits'][a][b]:.3f}" for b in spec["domains"]))
        console.print(div)

    pre = _table("prefetch headroom: layer l's top-1 predicting layer l+1's experts (held-out half)",
                 ["layers", "guessed", "recall from layer l", "recall of the most popular"])
    for k, v in stats["prefetch"].items():
        pre.add_row(k, str(v["guessed"]), _pct(v["recall_from_previous_layer"]), _pct(v["recall_most_popular"]))
    console.print(pre)

    pairs = _table("most co-activated expert pairs", ["layer", "pairs (tokens, lift)", "distinct pairs seen"])
    for l, c in stats["coactivation"].items():
        pairs.add_row(l, "  ".join(f"{p['experts'][0]}+{p['experts'][1]} ({p['tokens']}, {p['lift']:.1f})"
                                   for p in c["top_pairs"][:3]), f"{c['distinct_pairs']:,} of {c['possible_pairs']:,}")
    console.print(pairs)

    curve = stats["hit_rate"]
    if curve is not None:
        hits = _table("expert-cache hit rate against slots per layer (replayed)",
                      ["slots", "share", *curve["hit_rate"]])
        for i, s in enumerate(curve["slots"]):
            hits.add_row(str(s), f"{curve['share'][i]:.0%}", *(_pct(r[i]) for r in curve["hit_rate"].values()))
        console.print(hits)
    for note in stats["notes"]:
        console.print(f"note: {note}")
