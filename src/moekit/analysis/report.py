"""`moekit report`: run labelled prompts, trace them, analyse the trace, score the routing
policies, and write one self-contained HTML page (images embedded, no network)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moekit.analysis import plots
from moekit.analysis.activation import per_token
from moekit.analysis.trace_data import RoutingTrace


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    png: str
    text: str = ""
    caption: str = ""
    tables: tuple = ()


def _pct(x) -> str:
    return "—" if x is None else f"{x:.1%}"


def summary_lines(stats: dict, routing: dict | None, params, policy_name: str) -> list[str]:
    """What a reader should take away, in sentences built from the measured figures."""
    act, lines = stats["activation"], []
    share = act["share"]
    lines.append(
        f"Measured active share ({act['share_of']}, routing {policy_name}): mean {share['mean']:.2%}, "
        f"p5 {share['p5']:.2%}, p95 {share['p95']:.2%}, over {share['tokens']:,} tokens; "
        f"{act['experts_per_token']['mean']:.2f} routed experts per token summed over "
        f"{len(stats['layers'])} MoE layers.")
    if params is not None:
        fixed = params.active({}) / params.total_params
        each = {params.expert_each[l] for l in params.expert_each}
        spread = "the same for every token" if share["max"] - share["min"] < 1e-9 else \
            f"from {share['min']:.2%} to {share['max']:.2%}"
        lines.append(
            f"What drives it: {fixed:.2%} of the parameters (attention, norms, routers, embedding and head) are "
            f"read by every token; each routed expert adds {min(each) / params.total_params:.3%}. "
            f"The share is {spread}: it moves only when a token uses a different number of experts.")
    by_domain = act["by_domain"]
    if len(by_domain) > 1:
        lines.append("Per domain, mean active share: " + ", ".join(
            f"{d} {v['mean']:.2%}" for d, v in by_domain.items() if v is not None) + ".")
    unhealthy = stats["overall"]["unhealthy_layers"]
    lines.append("Router health: " + ("every layer healthy" if not unhealthy else ", ".join(
        f"layer {l} {v}" for l, v in unhealthy.items())) +
        f"; the hottest 10% of experts serve {_pct(stats['overall']['hot10_share'])} of assignments (mean over "
        f"layers), {stats['overall']['unused']} expert slots never used.")
    spec = stats["specialisation"]
    if len(spec["domains"]) > 1:
        pairs = [(spec["js_bits"][a][b], a, b) for i, a in enumerate(spec["domains"]) for b in spec["domains"][i + 1:]]
        hi, lo = max(pairs), min(pairs)
        lines.append(f"Specialisation: the most different domains are {hi[1]} and {hi[2]} (Jensen–Shannon "
                     f"{hi[0]:.3f} bits of 1), the most alike {lo[1]} and {lo[2]} ({lo[0]:.3f}).")
    reuse = [v["same_experts"] for v in stats["reuse"].values() if v["same_experts"] is not None]
    if reuse:
        lines.append(f"Reuse: a token keeps all of the previous token's experts {np.mean(reuse):.1%} of the time "
                     f"(mean over layers).")
    curve = stats["hit_rate"]
    if curve is not None:
        quarter = min(range(len(curve["slots"])), key=lambda i: abs(curve["share"][i] - 0.25))
        lines.append(f"Expert cache: with {curve['slots'][quarter]} slots per layer ({curve['share'][quarter]:.0%} of "
                     f"the experts) LRU hits {_pct(curve['hit_rate']['lru'][quarter])}, Belady's bound "
                     f"{_pct(curve['hit_rate']['belady'][quarter])}.")
    if routing is not None:
        names = routing["policies"]
        cheaper = [n for n in names[1:] if routing["all"][n]["active_share"] < routing["all"][names[0]]["active_share"]]
        if cheaper:
            best = min(cheaper, key=lambda n: routing["all"][n]["delta_bits_per_byte"])
            r = routing["all"][best]
            lines.append(f"Routing policies: of those that touch fewer parameters, {best} costs least: "
                         f"{r['delta_bits_per_byte']:+.4f} bits per byte for a mean share of {r['active_share']:.2%} "
                         f"(exact {routing['all'][names[0]]['active_share']:.2%}), next-token agreement "
                         f"{_pct(r['next_token_agreement'])}.")
    return lines


def _layer_table(stats: dict) -> dict:
    head = ["layer", "max/mean", "CV", "hottest 10%", "unused", "load entropy (bits)", "top-1 share",
            "top-1 ≥ 0.85", "same experts as previous token", "verdict"]
    rows = []
    for l, s in stats["layers"].items():
        rows.append([l, f"{s['max_over_mean']:.2f}", f"{s['cv']:.2f}", _pct(s["hot10_share"]), s["unused"],
                     f"{s['load_entropy_bits']:.2f} / {s['load_entropy_max_bits']:.2f}", _pct(s["top1_share_mean"]),
                     _pct(s["top1_confident_share"]), _pct(stats["reuse"][l]["same_experts"]), s["verdict"]])
    return {"head": head, "rows": rows}


def _routing_table(routing: dict) -> dict:
    head = ["policy", "bits/byte", "Δ vs exact", "experts/token/layer", "active share", "next-token agreement",
            "generated agreement"]
    rows = [[n, f"{r['bits_per_byte']:.4f}", f"{r['delta_bits_per_byte']:+.4f}", f"{r['experts_per_token']:.2f}",
             _pct(r["active_share"]), _pct(r["next_token_agreement"]), _pct(r["generated_agreement"])]
            for n, r in routing["all"].items()]
    return {"head": head, "rows": rows}


def router_health(table) -> Figure | None:
    """Entropy drift per layer and ITL jitter per prompt, with the flags (engine/router_health.py),
    from a trace with the `entropy` column (and `itl_jitter`, which report traces carry)."""
    from moekit.engine import router_health as rh
    from moekit.engine.trace import read_trace_model

    if table is None or "entropy" not in table.column_names or table["entropy"].null_count == table.num_rows:
        return None
    model = read_trace_model(table.schema.metadata)
    layers = table["layer"].to_pylist()
    experts = model.experts if model is not None else {l: 2 for l in set(layers)}
    drift = rh.entropy_drift(layers, table["position"].to_pylist(), table["entropy"].to_pylist(), experts)
    jitters: dict[str, float | None] = {}
    if "itl_jitter" in table.column_names:
        for row, j in zip(table["row"].to_pylist(), table["itl_jitter"].to_pylist()):
            jitters.setdefault(f"prompt {row}", j)
    flags = rh.health_flags(drift, jitters)
    shown = [j for j in jitters.values() if j is not None]
    width = max(len(d.buckets) for d in drift)
    drift_rows = [[f"layer {d.layer}"] + [f"{b[1]:.3f}" for b in d.buckets] + ["—"] * (width - len(d.buckets))
                  + [f"{d.mean:.3f}", "yes" if d.collapses else "no"] for d in drift]
    head = ["layer"] + [f"pos {i * rh.POSITION_BUCKET}+" for i in range(width)] + ["mean", "collapses"]
    text = (f"ITL jitter index (std/mean of the gaps between a prompt's tokens, batch 1): median "
            f"{float(np.median(shown)):.2f}, max {max(shown):.2f} over {len(shown)} prompts. " if shown else "")
    text += ("Flags: " + "; ".join(flags) + "." if flags else "No layer's entropy collapses and no prompt's jitter is high.")
    return Figure("router-health", "Routing entropy over position, and ITL jitter", plots.entropy_drift_plot(drift), text=text,
                  tables=({"head": head, "rows": drift_rows},),
                  caption=f"Entropy of each token's full routing distribution over E, divided by ln E, averaged per "
                          f"{rh.POSITION_BUCKET} positions. A layer is flagged when its last bucket falls below "
                          f"{rh.COLLAPSE_RATIO:g}× its first or its mean below {rh.COLLAPSE_FLOOR:g}; a prompt when its "
                          f"jitter index is above {rh.JITTER_HIGH:g}.")


def figures(trace: RoutingTrace, stats: dict, routing: dict | None, params, table=None) -> list[Figure]:
    tok = per_token(trace, params)
    shares = {d: tok["share"][tok["domain"] == d] for d in trace.domains}
    busiest = max(stats["coactivation"], key=lambda l: max([p["lift"] for p in stats["coactivation"][l]["top_pairs"]]
                                                          or [0]))
    out = [
        Figure("share", "Active share per token", plots.share_histogram(shares, stats["activation"]["share_of"]),
               caption="Each token's share of the parameters it touched, stacked by domain."),
        Figure("load", "Expert load, layer × expert", plots.load_heatmap(stats),
               tables=(_layer_table(stats),)),
        Figure("entropy", "Router health per layer", plots.entropy_per_layer(stats),
               caption="Load entropy near 1 means load spread over all experts; the top-1 share is the first "
                       "expert's part of each token's combine weights."),
    ]
    domain = plots.domain_heatmap(stats)
    if domain is not None:
        out.append(Figure("domains", "Expert usage per domain", domain,
                          caption="Usage over each domain's tokens; bright columns are experts a domain prefers."))
    pairs = stats["coactivation"][busiest]["top_pairs"]
    out.append(Figure("coactivation", f"Co-activation of expert pairs (layer {busiest})",
                      plots.coactivation_plot(trace, int(busiest)),
                      tables=({"head": ["pair", "tokens", "lift"],
                               "rows": [[f"{p['experts'][0]} + {p['experts'][1]}", p["tokens"], f"{p['lift']:.1f}"]
                                        for p in pairs]},)))
    if stats["hit_rate"] is not None:
        prefetch = stats["prefetch"]
        out.append(Figure("hitrate", "Expert-cache hit rate against slots per layer", plots.hit_rate_plot(stats["hit_rate"]),
                          text="What --expert-memory buys: the trace replayed through the expert store's cache.",
                          tables=({"head": ["layers", "recall from the previous layer's top-1", "recall of the most popular"],
                                   "rows": [[k, _pct(v["recall_from_previous_layer"]), _pct(v["recall_most_popular"])]
                                            for k, v in prefetch.items()]},),
                          caption="The table: how well layer l's choice predicts layer l+1's experts "
                                  "(headroom for a cross-layer prefetcher; fit on half the tokens, scored on the rest)."))
    health = router_health(table)
    if health is not None:
        out.append(health)
    if routing is not None:
        out.append(Figure("pareto", "Routing policies: active share against bits per byte", plots.pareto_plot(routing),
                          tables=(_routing_table(routing),),
                          caption="Held-out text, teacher-forced; agreement is with exact routing's greedy tokens."))
    return out


def render(model: str, facts: str, summary: list[str], figs: list[Figure], command: str) -> str:
    import jinja2

    from moekit import __version__

    env = jinja2.Environment(loader=jinja2.PackageLoader("moekit.analysis", "templates"),
                             autoescape=jinja2.select_autoescape(["html"]))
    return env.get_template("report.html").render(model=model, facts=facts, summary=summary, figures=figs,
                                                  command=command, version=__version__)
