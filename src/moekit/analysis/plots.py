"""The report's figures, drawn with matplotlib (Agg: no display) and returned as base64 PNG, so
the HTML embeds them and opens offline. Each function takes the analysis dict (and the trace where
a figure needs more than the summary) and returns one image."""

from __future__ import annotations

import base64
import io
from typing import Optional

import numpy as np

from moekit.analysis.reuse_stats import coactivation_matrix
from moekit.analysis.trace_data import RoutingTrace


def _figure(width=7.0, height=3.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    return plt, fig, ax


def _png(plt, fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def load_heatmap(stats: dict) -> str:
    plt, fig, ax = _figure(7.0, 2.6)
    layers = list(stats["layers"])
    load = np.array([np.array(stats["layers"][l]["counts"]) / max(1e-9, np.mean(stats["layers"][l]["counts"]))
                     for l in layers])
    im = ax.imshow(load, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_yticks(range(len(layers)), [f"layer {l}" for l in layers])
    ax.set_xlabel("expert")
    ax.set_title("expert load (× the mean)")
    fig.colorbar(im, ax=ax)
    return _png(plt, fig)


def domain_heatmap(stats: dict) -> Optional[str]:
    """Domains × (layer, expert): each layer's experts side by side (an expert id means nothing
    across layers, so layers are not averaged)."""
    spec = stats["specialisation"]
    if len(spec["domains"]) < 2:
        return None
    plt, fig, ax = _figure(7.5, 0.45 * len(spec["domains"]) + 1.5)
    layers = list(spec["usage"][spec["domains"][0]])
    usage = np.array([np.concatenate([np.array(spec["usage"][d][l]) * len(spec["usage"][d][l]) for l in layers])
                      for d in spec["domains"]])
    im = ax.imshow(usage, aspect="auto", cmap="viridis", interpolation="nearest")
    width = usage.shape[1] / len(layers)
    for i in range(1, len(layers)):
        ax.axvline(i * width - 0.5, color="white", linewidth=1.5)
    ax.set_xticks([(i + 0.5) * width for i in range(len(layers))], [f"layer {l} experts" for l in layers])
    ax.set_yticks(range(len(spec["domains"])), spec["domains"])
    ax.set_title("expert usage per domain (× uniform)")
    fig.colorbar(im, ax=ax)
    return _png(plt, fig)


def share_histogram(shares: dict[str, np.ndarray], label: str) -> str:
    plt, fig, ax = _figure()
    percent = {d: v * 100 for d, v in shares.items()}
    values = np.concatenate(list(percent.values()))
    lo, hi = float(values.min()), float(values.max())
    if hi - lo < 1e-6:  # every token alike: one bar, said in the title
        lo, hi = lo - 0.5, hi + 0.5
        ax.set_title(f"active share per token: {values[0]:.2f}% for every one of {len(values):,} tokens")
    else:
        ax.set_title("active share per token")
    ax.hist(list(percent.values()), bins=np.linspace(lo, hi, 31), stacked=True, label=list(percent))
    ax.set_xlabel(f"active share per token (%, {label})")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    return _png(plt, fig)


def entropy_per_layer(stats: dict) -> str:
    plt, fig, ax = _figure()
    layers = list(stats["layers"])
    load = [stats["layers"][l]["load_entropy_bits"] / stats["layers"][l]["load_entropy_max_bits"] for l in layers]
    top1 = [stats["layers"][l]["top1_share_mean"] for l in layers]
    x = np.arange(len(layers))
    ax.bar(x - 0.2, load, 0.4, label="load entropy / log2 E")
    ax.bar(x + 0.2, top1, 0.4, label="mean top-1 share of the combine")
    ax.set_xticks(x, [f"layer {l}" for l in layers])
    ax.set_ylim(0, 1.05)
    ax.set_title("router health per layer")
    ax.legend(fontsize=8, loc="lower right")
    return _png(plt, fig)


def entropy_drift_plot(drift) -> str:
    """drift: engine.router_health.Drift per layer → normalised routing entropy against position."""
    plt, fig, ax = _figure()
    for d in drift:
        ax.plot([b[0] for b in d.buckets], [b[1] for b in d.buckets], marker="o", label=f"layer {d.layer}")
    ax.set_xlabel("position (bucket start)")
    ax.set_ylabel("routing entropy / ln E")
    ax.set_ylim(0, 1.05)
    ax.set_title("router entropy over position")
    ax.legend(fontsize=8, loc="lower right")
    return _png(plt, fig)


def coactivation_plot(trace: RoutingTrace, layer: int) -> str:
    plt, fig, ax = _figure(4.6, 4.0)
    both = coactivation_matrix(trace, layer).astype(np.float64)
    np.fill_diagonal(both, 0)
    im = ax.imshow(np.log1p(both), cmap="Blues", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("expert")
    ax.set_title(f"co-activation, layer {layer} (log(1 + tokens))")
    fig.colorbar(im, ax=ax)
    return _png(plt, fig)


def hit_rate_plot(curve: dict) -> str:
    plt, fig, ax = _figure()
    for policy, rates in curve["hit_rate"].items():
        ax.plot(curve["slots"], [r * 100 for r in rates], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_xticks(curve["slots"], [str(s) for s in curve["slots"]])
    ax.minorticks_off()
    ax.set_xlabel("expert slots per layer")
    ax.set_ylabel("hit rate (%)")
    ax.set_title("expert-cache hit rate (replayed trace)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png(plt, fig)


def pareto_plot(routing: dict) -> str:
    plt, fig, ax = _figure(7.0, 3.6)
    for name, r in routing["all"].items():
        exact = name == "exact"  # drawn last and largest: policies that keep every expert sit on it
        ax.scatter(r["active_share"] * 100, r["bits_per_byte"], s=160 if exact else 40, marker="*" if exact else "o",
                   color="black" if exact else None, zorder=3 if exact else 2, label=f"{name}: {r['bits_per_byte']:.3f}")
    ax.set_xlabel("mean active share (%)")
    ax.set_ylabel("bits per byte (held-out)")
    ax.set_title("routing policies: parameters touched vs quality (lower left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _png(plt, fig)
