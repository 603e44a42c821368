"""What a trained model's heads attend to: the weights of one layer's heads on one text (for Figure-1 style
pictures, routing heads coloured by cluster) and, over the data, the clusters of every routing head: their sizes,
balance, and how much of full attention's mass the routed keys capture."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.masks import full_mask
from ..attention.reference import reference_weights
from ..model import TransformerLM
from .heads import HeadCall, capture


@dataclass
class HeadPattern:
    """One head on one sequence: weights (N, N) (row = output, column = input) and, for routing heads, the cluster
    of every query (N,)."""

    layer: int
    head: int
    kind: str
    weights: Tensor
    clusters: Tensor | None


@torch.no_grad()
def head_patterns(model: TransformerLM, tokens: Tensor, layer: int, head: int | None = None) -> list[HeadPattern]:
    """The patterns of ``head`` (default every head) of ``layer`` on one sequence of tokens (N,) or (1, N)."""
    tokens = tokens.reshape(1, -1)
    out = []
    for call in capture(model, tokens, [layer]):
        weights = call.weights()[0]  # (h, N, N)
        clusters = call.group.clusters(call.q, call.k)
        for i, h in enumerate(call.heads):
            if head is None or h == head:
                out.append(HeadPattern(layer, h, call.kind, weights[i].float().cpu(),
                                       None if clusters is None else clusters[0, i].cpu()))
    if head is not None and not out:
        raise ValueError(f"head {head} does not exist: layer {layer} has heads 0..{model.config.heads - 1}")
    return out


@dataclass
class ClusterStats:
    """A routing head over the data: mean positions per cluster per sequence (by the queries' clusters, which are
    also the keys' unless routing is separate), sorted from the largest (k,); balance
    (the largest cluster over the mean size, averaged over sequences; 1 is perfectly balanced); and the mean share
    of full attention's mass (softmax over every key the head could see without routing) its routed keys hold."""

    layer: int
    head: int
    sizes: Tensor
    balance: float
    captured: float


@torch.no_grad()
def cluster_stats(model: TransformerLM, batches: Iterable[Tensor],
                  layers: list[int] | None = None) -> list[ClusterStats]:
    """``ClusterStats`` of every routing head (every group whose ``clusters`` is not None) over ``batches``."""
    sums: dict[tuple[int, int], list] = {}
    for tokens in batches:
        for call in capture(model, tokens, layers):
            clusters = call.group.clusters(call.q, call.k)
            if clusters is None:
                continue
            routed = call.weights()  # (B, h, N, N)
            full = _unrouted(call, routed)
            captured = (full * (routed > 0)).sum(-1).mean((0, 2))  # (h,)
            k = call.group.num_clusters or int(clusters.max()) + 1
            sizes = F.one_hot(clusters, k).sum(2).float()  # (B, h, k)
            balance = (sizes.max(-1).values / sizes.mean(-1)).mean(0)  # (h,)
            ordered = sizes.sort(-1, descending=True).values.mean(0).cpu()  # (h, k)
            for i, h in enumerate(call.heads):
                entry = sums.setdefault((call.layer, h), [0, torch.zeros(0), 0.0, 0.0])
                entry[0] += 1
                width = max(k, len(entry[1]))
                entry[1] = F.pad(entry[1], (0, width - len(entry[1]))) + F.pad(ordered[i], (0, width - k))
                entry[2] += float(balance[i])
                entry[3] += float(captured[i])
    return [ClusterStats(layer, head, s / n, b / n, c / n) for (layer, head), (n, s, b, c) in sorted(sums.items())]


def _unrouted(call: HeadCall, routed: Tensor) -> Tensor:
    """The head's weights with routing removed: every key j <= i (its own key only where the head would see it,
    as shared-QK routing drops it), same scores (relative positions included) and kernel."""
    q = call.q
    N = q.shape[2]
    eye = torch.eye(N, dtype=torch.bool, device=q.device)
    own = (routed > 0) | (routed.sum(-1, keepdim=True) == 0)  # (B, h, N, N): rows that see nothing keep all
    mask = full_mask(N, device=q.device) & (~eye | own)
    group = call.group
    return reference_weights(q, group.reference_keys(q, call.k), mask, scale=group.kernel_scale,
                             rel_pos=call.rel_pos, kernel=group.kernel)


def format_cluster_stats(stats: list[ClusterStats]) -> str:
    if not stats:
        return "no routing heads"
    lines = [f"{'layer':>5} {'head':>4} {'clusters used':>13} {'largest':>8} {'mean':>6} {'balance':>8} "
             f"{'captured':>9}"]
    for s in stats:
        used = int((s.sizes > 0.5).sum())
        lines.append(f"{s.layer:>5} {s.head:>4} {used:>8} of {len(s.sizes):<3} {float(s.sizes[0]):>8.1f} "
                     f"{float(s.sizes.mean()):>6.1f} {s.balance:>8.2f} {s.captured:>9.3f}")
    return "\n".join(lines)
