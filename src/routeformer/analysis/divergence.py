"""How differently the heads of a layer attend: the Jensen-Shannon divergence between their attention
distributions (the Routing Transformer paper's Table 4: local-local small, local-routing near ln 2).

Each head's distribution over keys is its exact weights (``HeadGroup.reference_weights``): dense (B, h, N, N) at
the model's seq_len, so sparse heads are exact (their zeros are real zeros), and memory is O(H·N²) per sequence.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..model import TransformerLM
from .heads import capture

LN2 = math.log(2.0)


def js_divergence(p: Tensor, q: Tensor) -> Tensor:
    """Jensen-Shannon divergence (natural log, in [0, ln 2]) between distributions along the last dim:
    ½ KL(p ‖ m) + ½ KL(q ‖ m), m = (p + q) / 2, with 0 · log 0 = 0. p, q (..., N) -> (...)."""
    m = (p + q) / 2

    def kl(a: Tensor) -> Tensor:
        return torch.where(a > 0, a * (a.clamp_min(1e-30).log() - m.clamp_min(1e-30).log()), 0.0).sum(-1)

    return 0.5 * (kl(p) + kl(q))


@dataclass
class LayerDivergence:
    """One layer: the heads' kinds (H,), the mean and standard deviation over batches of the pairwise divergence
    (H, H), and per kind pair ('local-routing', ...) the mean and standard deviation over batches of its pairs'
    average."""

    layer: int
    kinds: list[str]
    mean: Tensor
    std: Tensor
    pairs: dict[str, tuple[float, float]]


@torch.no_grad()
def head_divergences(model: TransformerLM, batches: Iterable[Tensor],
                     layers: list[int] | None = None) -> list[LayerDivergence]:
    """The divergences of every layer in ``layers`` (default all) over ``batches`` of (B, N) tokens: per batch the
    mean over sequences and positions (rows where both heads attend to something), then mean and standard
    deviation over the batches (std 0 with one batch)."""
    per_batch: dict[int, list[Tensor]] = {}
    kinds = [[spec.kind.name for spec in layer for _ in range(spec.heads)] for layer in model.config.head_groups()]
    for tokens in batches:
        by_layer: dict[int, list[Tensor]] = {}
        for call in capture(model, tokens, layers):
            by_layer.setdefault(call.layer, []).append(call.weights.float())  # (B, h, N, N) per group
        for layer, parts in by_layer.items():
            per_batch.setdefault(layer, []).append(_pairwise(torch.cat(parts, 1)))
    out = []
    for layer in sorted(per_batch):
        stack = torch.stack(per_batch[layer])  # (batches, H, H)
        out.append(LayerDivergence(layer, kinds[layer], stack.mean(0), _std(stack),
                                   _by_kind_pair(stack, kinds[layer])))
    if not out:
        raise ValueError("no batches to analyse")
    return out


def _pairwise(w: Tensor) -> Tensor:
    """(H, H) mean divergence between heads, over sequences and positions where both attend. w (B, H, N, N)."""
    H = w.shape[1]
    attends = w.sum(-1) > 0  # (B, H, N)
    out = torch.zeros(H, H)
    for a, b in itertools.combinations(range(H), 2):
        both = attends[:, a] & attends[:, b]
        value = float(js_divergence(w[:, a], w[:, b])[both].mean()) if both.any() else float("nan")
        out[a, b] = out[b, a] = value
    return out


def _std(stack: Tensor) -> Tensor:
    return stack.std(0, correction=1) if stack.shape[0] > 1 else torch.zeros_like(stack[0])


def _by_kind_pair(stack: Tensor, kinds: list[str]) -> dict[str, tuple[float, float]]:
    """Per kind pair, each batch's average over its head pairs, then mean and std over batches."""
    groups: dict[str, list[tuple[int, int]]] = {}
    for a, b in itertools.combinations(range(len(kinds)), 2):
        name = "-".join(sorted((kinds[a], kinds[b])))
        groups.setdefault(name, []).append((a, b))
    out = {}
    for name, pairs in groups.items():
        per = torch.stack([stack[:, a, b] for a, b in pairs], -1).mean(-1)  # (batches,)
        out[name] = (float(per.mean()), float(per.std(correction=1)) if per.numel() > 1 else 0.0)
    return out


def format_divergences(results: list[LayerDivergence]) -> str:
    """Per layer, mean ± std of each kind pair (nats; at most ln 2 = 0.693), then the pairwise means."""
    names = sorted({n for r in results for n in r.pairs})
    lines = [f"{'layer':<6}" + "".join(f"{n:>22}" for n in names)]
    for r in results:
        cells = [f"{r.pairs[n][0]:.3f} ± {r.pairs[n][1]:.3f}" if n in r.pairs else "-" for n in names]
        lines.append(f"{r.layer:<6}" + "".join(f"{c:>22}" for c in cells))
    lines.append("")
    for r in results:
        labels = [f"{h}:{k}" for h, k in enumerate(r.kinds)]
        lines.append(f"layer {r.layer}, pairwise mean (heads {', '.join(labels)}):")
        for a in range(len(labels)):
            lines.append("  " + " ".join(f"{float(r.mean[a, b]):.3f}" for b in range(len(labels))))
    return "\n".join(lines)


def write_divergence_csv(results: list[LayerDivergence], path) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "head_a", "kind_a", "head_b", "kind_b", "js_mean", "js_std"])
        for r in results:
            for a, b in itertools.combinations(range(len(r.kinds)), 2):
                w.writerow([r.layer, a, r.kinds[a], b, r.kinds[b], f"{float(r.mean[a, b]):.6f}",
                            f"{float(r.std[a, b]):.6f}"])
