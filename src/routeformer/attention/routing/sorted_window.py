"""Routed attention as a sliding window over the sequence sorted by (cluster, position).

Sorting by (cluster, position) puts each cluster's positions side by side, in order. The `window` most recent
same-cluster positions j <= i of position i are then the entries just before it in the sorted order: banded
attention over the sorted sequence, restricted to the same cluster, computes exactly "attend to the last `window`
positions of your own cluster", in O(N · window · D) time and memory whatever the sizes of the clusters. The keys a
position sees depend only on its own cluster and on earlier positions, so nothing later can change them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ...executors import Executor
from ...executors.inputs import Inputs, refuse_cross, relative
from ...executors.pieces import SortedWindow
from ...executors.relative import RelativePositions
from ...executors.tiling import Distances, KeyRestrictions
from .options import RoutingOptions


class ClusterOrder(NamedTuple):
    """A sequence sorted by (cluster, position); ``rank`` and ``counts`` only when ``num_clusters`` was given.

    order, inverse: (B, H, N); ``x.gather(-1, order)`` sorts, ``inverse`` undoes it. grouped: (B, H, N) the cluster
    of each sorted entry. rank: (B, H, N) rank of each sorted entry within its cluster. counts: (B, H, k) cluster sizes.
    """

    order: Tensor
    inverse: Tensor
    grouped: Tensor
    rank: Tensor | None = None
    counts: Tensor | None = None


def sort_by_cluster(clusters: Tensor, num_clusters: int | None = None) -> ClusterOrder:
    """Sort positions by (cluster, position): clusters (B, H, N) in [0, num_clusters). With ``num_clusters`` also
    each sorted entry's rank within its cluster and the cluster sizes."""
    n = clusters.shape[-1]
    pos = torch.arange(n, device=clusters.device)
    order = (clusters * n + pos).argsort(-1)  # keys are unique, so the order is the stable one
    # the inverse written here rather than by executors.rows.inverse_order: LSH's forward would reach an executor
    # module one frame deeper than test_hops allows
    inverse = torch.empty_like(order).scatter_(-1, order, pos.expand_as(order))
    grouped = clusters.gather(-1, order)
    if num_clusters is None:
        return ClusterOrder(order, inverse, grouped)
    counts = clusters.new_zeros(*clusters.shape[:-1], num_clusters).scatter_add_(-1, clusters,
                                                                                 torch.ones_like(clusters))
    start = counts.cumsum(-1) - counts  # first sorted index of each cluster
    rank = pos - start.gather(-1, grouped)
    return ClusterOrder(order, inverse, grouped, rank, counts)


def drop_own_key(allow: Tensor, own: Tensor) -> Tensor:
    """Shared QK: ``allow`` (..., M) without the query's own key (``own``, broadcastable to it), unless that key is
    the only one allowed."""
    others = (allow & ~own).any(-1, keepdim=True)
    return allow & ~(own & others)


def sorted_window_attention(
    inputs: Inputs,
    sort: ClusterOrder,
    options: RoutingOptions,
    *,
    executor: Executor,
    causal: bool = True,
    rel_pos: RelativePositions | None = None,
    need_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Each query attends to the ``options.window`` nearest positions of its own cluster (only earlier ones when
    causal); with ``options.shared_qk`` not to its own key unless it sees no other.

    inputs: the checked q, k, v (B, H, N, D), scale and key validity (B, 1, N) or None; sort: the positions sorted
    by their groups, ``sort_by_cluster(clusters)`` of any integer groups (B, H, N) (k-means clusters, hash buckets)
    -> (B, H, N, D). Causal: keys j <= i, the most recent ``window`` of the cluster; non-causal: |rank_i - rank_j| <
    window within the cluster. Time O(N · window · D + N log N), memory O(N · window) per head; the band runs on
    ``executor``.

    ``need_lse``: return (out, lse) with lse (B, H, N) the log-sum-exp of each query's scores, in float32 or wider,
    in the original position order (``neg_inf(lse.dtype)`` for a query that sees no key), so that several rounds of
    routing (one sort each) merge exactly with ``merge_partials``. The merge is a softmax over the multiset
    union of the rounds' keys: a key that k rounds share counts k times (its weight is raised by log k); it equals
    attention over the union of the masks (``sorted_window_mask``) when no two rounds share a (query, key) pair.
    """
    refuse_cross(inputs, "routing self-attention (routing_cross_attention reads a memory)")
    B, H, N, D = inputs.shape
    key_valid = inputs.key_valid
    order, inverse, grouped = sort[:3]
    valid = None if key_valid is None else key_valid.expand(B, H, N).gather(-1, order)
    restrict = KeyRestrictions(exclude_self=options.shared_qk)
    rel = relative(rel_pos, Distances(positions=order))  # between the entries' own positions
    # the band over the sorted sequence within each cluster: the executor reads rows by index or permutes them, and
    # may read each entry's keys as one interval of the sorted order (``SortedWindow``)
    piece = SortedWindow(options.window, causal, order, grouped, inverse=inverse)
    out, lse = executor.tiled(inputs.with_(key_valid=valid), piece, restrict=restrict, rel=rel, need_lse=need_lse)
    return (out, lse) if need_lse else out


def sorted_window_mask(clusters: Tensor, window: int, causal: bool, exclude_self: bool,
                       key_valid: Tensor | None = None) -> Tensor:
    """The boolean (B, H, N, N) mask of ``sorted_window_attention``, written from its definition (O(N²))."""
    n = clusters.shape[-1]
    idx = torch.arange(n, device=clusters.device)
    same = clusters[..., :, None] == clusters[..., None, :]  # (B, H, N, N)
    rank = (same & (idx[None, :] <= idx[:, None])).sum(-1) - 1  # position of i within its cluster
    gap = rank[..., :, None] - rank[..., None, :]  # rank_i - rank_j
    allow = same & ((gap >= 0) & (gap < window) if causal else gap.abs() < window)
    if key_valid is not None:
        allow = allow & key_valid[:, :, None, :]
    if exclude_self:
        allow = drop_own_key(allow, torch.eye(n, dtype=torch.bool, device=clusters.device))
    return allow
