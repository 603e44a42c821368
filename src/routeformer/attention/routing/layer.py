"""RoutingAttention: content-based sparse attention routed by online spherical k-means (Roy et al. 2020).

    q, k ──► Router (router.py): routing vectors r = n(·) · W_R, groups c = argmax_j <μ_j, r>    (B, H, N)
                                 └─► k-means statistics (training forward only)
    causal / sorted window: sort by (c, position) ─► banded attention, same cluster, last `window` ─► unsort
    separate routing (causal): the same over 2N events, key then query of each position (separate.py)
    balanced (non-causal):  each centroid takes its `window` nearest tokens ─► attention per cluster ─► lse merge

Centroids move only in ``update_routing()`` (see ``kmeans.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..checks import positive_int
from ..executors import check_backend
from ..inputs import check_inputs
from ..relative import RelativePositions
from .balanced import balanced_attention, balanced_mask, balanced_members
from .cache import RoutingCache
from .router import Router, update_routing
from .separate import event_order, interleave, separate_window_attention, separate_window_mask
from .sorted_window import sort_by_cluster, sorted_window_attention, sorted_window_mask

__all__ = ["RoutingAttention", "update_routing"]


class RoutingAttention(Router):
    """Routing attention over (B, H, N, D) queries, keys and values: a ``Router`` that attends within its groups.

    Args:
        heads, head_dim: H and D.
        num_clusters: k centroids per head (≈ sqrt(N) gives O(N^1.5 · D)).
        window: keys per query: the most recent ``window`` positions of the query's cluster (causal), or the
            ``window`` nearest in the cluster's order (non-causal sorted), or the size of each balanced cluster.
        causal: a query sees only positions <= its own. Causal routing is always the sorted window: the paper's
            balanced clusters choose members with later tokens and would leak the future into the past.
        shared_qk: queries and keys are the same vectors (pass k = q): the routing vector of a position comes from
            q, and a query does not attend to its own key unless no other key is visible (q_i·k_i would dominate).
            With ``shared_qk=False`` each position routes on normalise(n(q_i) + n(k_i)), one cluster per position
            (the paper assumes W_Q ≈ W_K, so q_i and k_i point alike), and its own key is an ordinary key.
        balanced: non-causal only. True: the paper's balanced clusters (each centroid takes its ``window`` nearest
            tokens; a token in several clusters attends to the union of their keys, merged exactly; a token in
            none attends to the keys of its nearest centroid's cluster). False: the sorted window without the
            causal constraint. Default: True when non-causal.
        separate: route queries by q and keys by k (needs shared_qk=False and causal=True): query i attends to
            the keys j <= i routed to its cluster, among the last ``window`` events (keys and queries) of that
            cluster (``separate.py``). A query and the key it needs can then meet in a cluster the way q and k meet
            in q·k; with one cluster per position they cannot be routed apart. Twice the attention work.
        decay, commitment: k-means EMA decay λ and the commitment-loss weight β.
        seed: seed of the fixed random orthonormal routing projection W_R.
        backend: the executor of the attention ("auto": FlexAttention on CUDA, tiles elsewhere; "tiles"; "flex").

    After ``forward`` in training mode, ``commitment_loss`` holds β · mean ||r - sg(μ_c)||² for the training loss
    (None after a forward in evaluation mode, which needs no loss).
    Time O(N·k·D + N·window·D), memory O(N·k + N·window) per head.

    The routing (``projection`` W_R, ``kmeans``, ``routing_vectors``, ``route``, ``route_keys``, the statistics and
    the commitment loss) is the ``Router`` this class extends, so the state_dict keys are the router's own
    (``projection``, ``kmeans.*``); the attention is ``sorted_window_attention``, ``separate_window_attention`` or
    ``balanced_attention`` over its groups.
    """

    def __init__(self, heads: int, head_dim: int, num_clusters: int, window: int, causal: bool = True,
                 shared_qk: bool = True, balanced: bool | None = None, separate: bool = False,
                 decay: float = 0.999, commitment: float = 1e-4, seed: int = 0, backend: str = "auto") -> None:
        for name, value in (("heads", heads), ("head_dim", head_dim), ("num_clusters", num_clusters)):
            positive_int(name, value)  # checked here first, in the order of the arguments
        window = positive_int("window", window)
        causal = bool(causal)
        if balanced is None:
            balanced = not causal
        if balanced and causal:
            raise ValueError("balanced=True needs causal=False: balanced clusters pick their members using later "
                             "tokens, which leaks the future into the past")
        if separate and (shared_qk or not causal):
            raise ValueError("separate=True routes queries and keys apart: it needs shared_qk=False and causal=True")
        super().__init__(heads, head_dim, num_clusters, shared_qk=shared_qk, separate=separate, decay=decay,
                         commitment=commitment, seed=seed)
        self.window, self.causal, self.balanced = window, causal, bool(balanced)
        self.backend = check_backend(backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
                key_padding_mask: Tensor | None = None, rel_pos: RelativePositions | None = None) -> Tensor:
        """(B, H, N, D) -> (B, H, N, D)."""
        _, _, _, _, scale, key_valid = check_inputs(q, k, v, scale, key_padding_mask, rel_pos)
        scores, clusters = self.assign_and_observe(q, k, key_padding_mask)  # (B, H, N, k), (B, H, N)
        if self.separate:
            return separate_window_attention(q, k, v, *self.split(clusters), window=self.window, scale=scale,
                                             key_valid=key_valid, rel_pos=rel_pos, backend=self.backend)
        if self.balanced:
            members = balanced_members(scores, self.window, key_padding_mask)
            return balanced_attention(q, k, v, members, clusters, exclude_self=self.shared_qk, scale=scale,
                                      key_valid=key_valid, rel_pos=rel_pos, backend=self.backend)
        return sorted_window_attention(q, k, v, clusters, window=self.window, causal=self.causal,
                                       exclude_self=self.shared_qk, scale=scale, key_valid=key_valid,
                                       rel_pos=rel_pos, backend=self.backend)

    @torch.no_grad()
    def routing_mask(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """The exact boolean (B, H, N, N) mask ``forward`` computes, for tests, figures and analysis at small N."""
        check_inputs(q, k, v=q, scale=None, key_padding_mask=key_padding_mask)
        scores = self.kmeans.scores(self.routing_vectors(q, k))
        clusters = scores.argmax(-1)
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]
        if self.separate:
            return separate_window_mask(*self.split(clusters), self.window, valid)
        if self.balanced:
            members = balanced_members(scores, self.window, key_padding_mask)
            return balanced_mask(members, clusters, self.shared_qk, valid)
        return sorted_window_mask(clusters, self.window, self.causal, self.shared_qk, valid)

    def update_routing(self, group: dist.ProcessGroup | None = None) -> None:
        """The k-means step: apply the statistics observed since the last call (all-reduced across ranks)."""
        self.update(group)

    def new_cache(self, batch: int, max_len: int | None, *, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float32) -> RoutingCache:
        """An empty decoding cache for up to ``max_len`` positions (causal only); None: the caller checks the
        length itself (as ``TransformerLM``'s cache does, once for every layer)."""
        if not self.causal:
            raise ValueError("incremental decoding needs causal=True")
        return RoutingCache.empty(batch, self.heads, self.num_clusters, self.window, self.head_dim,
                                  max_len=max_len, device=device or self.projection.device, dtype=dtype)

    @torch.no_grad()
    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache: RoutingCache, *, scale: float | None = None,
               rel_pos: RelativePositions | None = None) -> Tensor:
        """Outputs (B, H, n, D) of n new positions (B, H, n, D), continuing ``cache`` and updating it in place.

        Equal to the causal forward over the whole sequence at those positions. A new token costs O(k·D + window·D)
        per head whatever its position: it is routed, written to its cluster's ring buffer of the last ``window``
        keys and values (separate routing: its key to its key cluster's buffer, then an empty slot for its query
        event to its query cluster's), and attends over its query cluster's buffer. A prompt given to an empty
        cache runs the forward once and fills the buffers in one pass.
        """
        _, _, n, D, scale, _ = check_inputs(q, k, v, scale, None, rel_pos)
        cache.check(n)
        clusters = self.assign(q, k)  # (B, H, n), or (B, H, 2n) events if separate
        query_clusters, key_clusters = self.split(clusters)
        if cache.length == 0 and n > 1:  # a prompt: one forward, then every cluster's last `window` at once
            if self.separate:  # the buffers hold events: a query event's slot stays empty
                sort = event_order(query_clusters, key_clusters, self.num_clusters)
                out = separate_window_attention(q, k, v, query_clusters, key_clusters, window=self.window,
                                                scale=scale, rel_pos=rel_pos, sort=sort)
                cache.fill(interleave(k, torch.zeros_like(k)), interleave(v, torch.zeros_like(v)), sort, events=True)
            else:
                sort = sort_by_cluster(clusters, self.num_clusters)  # one sort for both
                out = sorted_window_attention(q, k, v, clusters, window=self.window, causal=True,
                                              exclude_self=self.shared_qk, scale=scale, rel_pos=rel_pos, sort=sort)
                cache.fill(k, v, sort)
            return out
        outs = [cache.step(q[:, :, t], k[:, :, t], v[:, :, t], query_clusters[:, :, t], scale=scale,
                           exclude_self=self.shared_qk, rel_pos=rel_pos,
                           key_cluster=key_clusters[:, :, t] if self.separate else None) for t in range(n)]
        return torch.stack(outs, dim=2)

    def extra_repr(self) -> str:
        mode = "causal" if self.causal else ("balanced" if self.balanced else "sorted window")
        return (f"heads={self.heads}, head_dim={self.head_dim}, num_clusters={self.num_clusters}, "
                f"window={self.window}, {mode}, shared_qk={self.shared_qk}, separate={self.separate}, "
                f"backend={self.backend}")

