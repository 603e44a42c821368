"""What a trained model's heads attend to: the weights of one layer's heads on one text (for Figure-1 style
pictures, routing heads coloured by cluster) and, over the data, the clusters of every routing head: their sizes,
balance, and how much of full attention's mass the routed keys capture."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.full import full_mask
from ..model import TransformerLM
from .heads import HeadCall, capture, check_layers


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
    """The patterns of ``head`` (default every head) of ``layer`` on one sequence of tokens (N,) or (1, N); a
    ValueError names a layer or head that does not exist."""
    check_layers(model, [layer])
    if head is not None and not 0 <= head < model.config.heads:
        raise ValueError(f"head {head} does not exist: layer {layer} has heads 0..{model.config.heads - 1}")
    out = []
    for call in capture(model, tokens.reshape(1, -1), [layer]):
        weights = call.weights[0]  # (h, N, N)
        clusters = call.group.clusters(call.q, call.k)
        for i, h in enumerate(call.heads):
            if head is None or h == head:
                out.append(HeadPattern(layer, h, call.kind, weights[i].float().cpu(),
                                       None if clusters is None else clusters[0, i].cpu()))
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
    per_batch: dict[tuple[int, int], list[tuple[Tensor, float, float]]] = {}
    for tokens in batches:
        for call in capture(model, tokens, layers):
            clusters = call.group.clusters(call.q, call.k)
            if clusters is None:
                continue
            captured = (_unrouted(call) * call.allowed).sum(-1).mean((0, 2))  # (h,)
            sizes = F.one_hot(clusters, call.group.num_clusters).sum(2).float()  # (B, h, k)
            balance = (sizes.max(-1).values / sizes.mean(-1)).mean(0)  # (h,)
            ordered = sizes.sort(-1, descending=True).values.mean(0).cpu()  # (h, k)
            for i, h in enumerate(call.heads):
                per_batch.setdefault((call.layer, h), []).append((ordered[i], float(balance[i]), float(captured[i])))
    out = []
    for (layer, head), rows in sorted(per_batch.items()):
        sizes, balance, captured = zip(*rows, strict=True)
        out.append(ClusterStats(layer, head, torch.stack(sizes).mean(0), sum(balance) / len(rows),
                                sum(captured) / len(rows)))
    return out


def _unrouted(call: HeadCall) -> Tensor:
    """The head's weights with routing removed: every key j <= i (its own key only where the head sees it, as
    shared-QK routing drops it; rows that see nothing keep it), same scores (relative positions included) and
    kernel."""
    N = call.q.shape[2]
    eye = torch.eye(N, dtype=torch.bool, device=call.q.device)
    own = call.allowed | ~call.allowed.any(-1, keepdim=True)
    return call.restricted(full_mask(N, device=call.q.device) & (~eye | own))


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
