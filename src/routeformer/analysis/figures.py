"""The analysis figures (matplotlib, PNG, written atomically). Each returns False when matplotlib is not installed."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..durable import atomic_write
from .divergence import LN2, LayerDivergence
from .patterns import ClusterStats, HeadPattern
from .substitution import ApproximationResult


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def _panels(plt, n: int, width: float, height: float):
    """A figure of n panels, at most 4 per row, each width × height inches: (figure, the n axes to draw on, the
    whole grid of axes); the unused ones are switched off."""
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), dpi=120, squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n], axes


def plot_approximations(own: float, results: list[ApproximationResult], unit: str, path: Path, title: str) -> bool:
    """The metric of each method against r (log scale), the model's own as a dashed line."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name in dict.fromkeys(r.method.name for r in results if r.method.r is not None):
        rows = [r for r in results if r.method.name == name and math.isfinite(r.value)]
        ax.plot([r.method.r for r in rows], [r.value for r in rows], marker="o", label=rows[0].method.label.rsplit(
            "-", 1)[0] if rows else name)
    ax.axhline(own, ls="--", color="black", lw=1, label="exact")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("r (keys per query; features for random features)")
    ax.set_ylabel(unit)
    if unit == "perplexity":
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path)
    return True


def plot_divergences(results: list[LayerDivergence], path: Path) -> bool:
    """One heat map per layer of the mean pairwise divergence (0 to ln 2)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, panels, axes = _panels(plt, len(results), 3.8, 3.3)
    image = None
    for ax, res in zip(panels, results, strict=True):
        image = ax.imshow(res.mean.numpy(), vmin=0.0, vmax=LN2, cmap="viridis")
        labels = [f"{h} {k}" for h, k in enumerate(res.kinds)]
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"layer {res.layer}", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="Jensen-Shannon divergence (nats)")
    # tight_layout fights the shared colour bar; a tight bounding box instead
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", bbox_inches="tight"))
    plt.close(fig)
    return True


def plot_patterns(patterns: list[HeadPattern], path: Path, title: str) -> bool:
    """Figure 1 of the routing paper: for each head, which inputs (columns) each output (row) attends to, the
    weights scaled to each row's largest; routing heads coloured by the query's cluster."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, panels, _ = _panels(plt, len(patterns), 3.6, 3.6)
    palette = plt.get_cmap("tab20")
    for ax, p in zip(panels, patterns, strict=True):
        w = p.weights
        strength = (w / w.amax(-1, keepdim=True).clamp_min(1e-30)).numpy()  # (N, N) in [0, 1]
        if p.clusters is None:
            rgba = torch.zeros(*w.shape, 4)  # black
        else:
            colours = torch.tensor([palette(int(c) % 20) for c in p.clusters.tolist()])  # (N, 4) per query
            rgba = colours[:, None, :].expand(*w.shape, 4).clone()
        rgba[..., 3] = torch.from_numpy(strength)  # opaque where attended
        ax.imshow(rgba.numpy(), interpolation="nearest")
        ax.set_title(f"layer {p.layer} head {p.head}: {p.kind}", fontsize=9)
        ax.set_xlabel("input (key) position", fontsize=8)
        ax.set_ylabel("output (query) position", fontsize=8)
    fig.suptitle(title, fontsize=9)
    _save(plt, fig, path)
    return True


def plot_cluster_sizes(stats: list[ClusterStats], path: Path) -> bool:
    """For each routing head, the mean positions per cluster per sequence, largest first."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, panels, _ = _panels(plt, len(stats), 3.2, 2.6)
    for ax, s in zip(panels, stats, strict=True):
        ax.bar(range(len(s.sizes)), s.sizes.numpy(), color="tab:blue")
        ax.axhline(float(s.sizes.mean()), ls="--", color="black", lw=1)
        ax.set_title(f"layer {s.layer} head {s.head}: balance {s.balance:.2f}, captured {s.captured:.2f}",
                     fontsize=8)
        ax.set_xlabel("cluster (largest first)", fontsize=8)
        ax.set_ylabel("positions per sequence", fontsize=8)
    _save(plt, fig, path)
    return True


def plot_recurrence(rows, path: Path, title: str) -> bool:
    """Bars of the loss difference (model - baseline) by the distance to the previous occurrence of the context,
    with the share of positions in each bin; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    labels = [r.label for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.bar(labels, [r.loss - r.baseline for r in rows], color=["tab:green" if r.loss < r.baseline else "tab:red"
                                                                 for r in rows])
    top.axhline(0, color="black", linewidth=0.5)
    top.set_ylabel("routing - baseline (bits)")
    top.set_title(title, fontsize=8)
    total = sum(r.positions for r in rows) or 1
    bottom.bar(labels, [100 * r.positions / total for r in rows], color="tab:gray")
    bottom.set_ylabel("positions %")
    bottom.set_xlabel("distance to the previous occurrence of the last tokens")
    bottom.tick_params(axis="x", labelrotation=30)
    _save(plt, fig, path)
    return True
