"""Separate query and key routing: a position is a query in the cluster of its query vector and a key in the
cluster of its key vector, and a query attends to the keys routed to its own cluster.

Why: with one cluster per position, a query and the key it needs must share a cluster through a single vector
built from both; routing queries by q and keys by k lets W_Q and W_K learn to meet in a cluster, as they meet in
q·k. Measured on the recall benchmark (README, "Routing that learns"): routing apart with a window of the last
keys of the cluster (an O(N²) mask experiment) learned mqar far better than one cluster per position, but this
exact form, whose window counts the cluster's query events too, did not: unbalanced clusters push the needed key
out of the window. It is an option for experiments, not the default.

Exact and causal, with the sorted-window executor: every position p becomes two *events*, its key event
(cluster c_k(p)) then its query event (cluster c_q(p)). Sorting the 2N events by (cluster, position, key before
query) puts each cluster's events side by side in time order; a query attends to the key events among the last
``window`` events of its cluster (so to at most ``window`` keys j <= p), as banded attention over the sorted
events. Which keys a query sees depends only on positions <= p: nothing later can change it. Cost: 2N rows of
``window`` keys, twice the one-cluster sorted window at the same window.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..executors import KeyRestrictions, get_executor
from ..relative import RelativePositions
from .sorted_window import ClusterOrder, permute_seq, sort_by_cluster


def interleave(key_side: Tensor, query_side: Tensor) -> Tensor:
    """(B, H, N, ...) twice -> (B, H, 2N, ...): event 2p is position p's key event, 2p + 1 its query event."""
    B, H, N = key_side.shape[:3]
    return torch.stack([key_side, query_side], dim=3).reshape(B, H, 2 * N, *key_side.shape[3:])


def event_order(query_clusters: Tensor, key_clusters: Tensor, num_clusters: int | None = None) -> ClusterOrder:
    """``sort_by_cluster`` of the 2N events (B, H, 2N): by (cluster, position, key event first)."""
    return sort_by_cluster(interleave(key_clusters, query_clusters), num_clusters)


def separate_window_attention(q: Tensor, k: Tensor, v: Tensor, query_clusters: Tensor, key_clusters: Tensor, *,
                              window: int, scale: float, key_valid: Tensor | None = None,
                              rel_pos: RelativePositions | None = None, sort: ClusterOrder | None = None,
                              backend: str = "auto") -> Tensor:
    """Causal: query i attends to keys j <= i with key cluster c_k(j) = c_q(i), among the last ``window`` events
    of that cluster. q, k, v: (B, H, N, D); clusters (B, H, N); key_valid: (B, 1, N) or None -> (B, H, N, D).
    ``sort``: ``event_order(query_clusters, key_clusters)`` when the caller has it. Time and memory
    O(N · window · D) per head."""
    B, H, N, D = q.shape
    order, inverse, grouped = (sort if sort is not None else event_order(query_clusters, key_clusters))[:3]
    zeros = q.new_zeros(()).expand(B, H, N, D)
    qe, ke, ve = interleave(zeros, q), interleave(k, zeros.to(k.dtype)), interleave(v, zeros.to(v.dtype))
    is_key = torch.arange(2 * N, device=q.device) % 2 == 0
    valid = is_key.expand(B, H, 2 * N) if key_valid is None else \
        interleave(key_valid.expand(B, H, N), torch.zeros(B, H, N, dtype=torch.bool, device=q.device))
    qs, ks, vs = (permute_seq(x, order, inverse) for x in (qe, ke, ve))
    restrict = KeyRestrictions(groups=grouped, positions=order // 2 if rel_pos is not None else None)
    out, _ = get_executor(backend, q.device).band(qs, ks, vs, window=window, causal=True, scale=scale,
                                 key_valid=valid.gather(-1, order), restrict=restrict, rel_pos=rel_pos)
    return permute_seq(out, inverse, order)[:, :, 1::2]


def separate_window_mask(query_clusters: Tensor, key_clusters: Tensor, window: int,
                         key_valid: Tensor | None = None) -> Tensor:
    """The boolean (B, H, N, N) mask of ``separate_window_attention``, from its definition (O(N²)): j <= i,
    c_k(j) = c_q(i), and key j's event among the last ``window`` events of that cluster up to query i's event."""
    n = query_clusters.shape[-1]
    idx = torch.arange(n, device=query_clusters.device)
    earlier = idx[None, :] <= idx[:, None]  # (N, N): j <= i
    c = query_clusters[..., :, None]  # (B, H, N, 1): the query's cluster
    # Events of cluster c_q(i) from key event j to query event i, both included: the key events and the query
    # events of positions j..i (position j's query event follows its key event, so it counts).
    keys_in = ((key_clusters[..., None, :] == c) & earlier).int()  # (B, H, N, N): key m of cluster c_q(i), m <= i
    queries_in = ((query_clusters[..., None, :] == c) & earlier).int()
    after_j_keys = keys_in.flip(-1).cumsum(-1).flip(-1)  # [i, j]: keys m in [j, i] of that cluster
    after_j_queries = queries_in.flip(-1).cumsum(-1).flip(-1)  # query events m in [j, i]
    span = after_j_keys + after_j_queries
    allow = (key_clusters[..., None, :] == c) & earlier & (span <= window)
    if key_valid is not None:
        allow = allow & key_valid[:, :, None, :]
    return allow
