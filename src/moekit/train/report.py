"""The demo model's plots: the loss curve (metrics.jsonl) and the domain × expert usage heat map (eval JSON).

    python -m moekit.train.report runs/demo/metrics.jsonl eval.json docs/

Needs matplotlib (the `docs` extra); nothing else in moekit does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def smooth(values: list[float], width: int) -> list[float]:
    """Trailing mean over `width` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def plot_loss(metrics: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    loss = [m["loss"] for m in metrics]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(steps, loss, color="#bbb", lw=0.8, label="loss (logged batch)")
    ax.plot(steps, smooth(loss, 10), color="#1f4e9c", lw=1.6, label="mean of last 10 logs")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    dropped = [100 * sum(l["dropped"] for l in m["layers"]) / len(m["layers"]) for m in metrics]
    imb = [m["imbalance"] for m in metrics]
    ax2.plot(steps, smooth(dropped, 10), color="#c0392b", label="assignments dropped by capacity (%)")
    ax2.plot(steps, smooth(imb, 10), color="#27ae60", label="load imbalance max/mean")
    ax2.set_xlabel("step")
    ax2.set_title("routing during training (mean over layers)")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_usage(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(result["domains"])
    layers = result["moe_layers"]
    fig, axes = plt.subplots(len(layers), 1, figsize=(12, 1.3 + 1.1 * len(domains) * len(layers) / 2), squeeze=False)
    for row, layer in enumerate(layers):
        ax = axes[row][0]
        grid = [result["domains"][d]["expert_usage"][row] for d in domains]
        im = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_yticks(range(len(domains)), domains)
        ax.set_ylabel(f"layer {layer}")
        if row == len(layers) - 1:
            ax.set_xlabel("expert")
        fig.colorbar(im, ax=ax, pad=0.01, label="share")
    fig.suptitle("share of each domain's expert assignments per expert (held-out tokens)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    metrics_path, eval_path, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    plot_loss(read_metrics(metrics_path), out / "demo_loss.png")
    plot_usage(json.loads(eval_path.read_text()), out / "demo_experts.png")


if __name__ == "__main__":
    main(sys.argv[1:])
