"""RoutingAttention: content-based sparse attention routed by online spherical k-means (Roy et al. 2020).

    q, k ──► Router (router.py): key clusters c(j), the p clusters P(i) each query probes       (B, H, N), (B, H, N, p)
                                 └─► k-means statistics and cluster loads (training forward only)
    causal, one probe:     sort by (c, position) ─► banded attention, same cluster, last `window` ─► unsort
    causal, several probes (or separate routing): the last `window` keys of each probed cluster, one softmax over
                           their union (probes.py)
    dense warm-up:         every earlier key, for the first `warmup` optimiser steps, while the routing learns
    hand-over:             then for `handover` steps every earlier key still, the keys routing would not score
                           pushed down by a penalty that grows to HANDOVER_PENALTY nats, so the heads move onto
                           the routed keys gradually instead of losing the rest at once
    balanced (non-causal): each centroid takes its `window` nearest tokens ─► attention per cluster ─► lse merge

Centroids and the balancing bias move only in ``update_routing()`` (see ``kmeans.py`` and ``router.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ...checks import positive_int
from ...executors import Backend, executor_for, get_executor
from ...executors.inputs import check_inputs
from ...executors.relative import RelativePositions
from ...executors.tiling import INDEX, KeyRestrictions, Tiling
from .balanced import balanced_attention, balanced_mask, balanced_members
from .cache import RoutingCache
from .probes import probed_window_attention, probed_window_mask, routed_pairs
from .router import Router, Routes, update_routing
from .sorted_window import drop_own_key, sort_by_cluster, sorted_window_attention, sorted_window_mask

__all__ = ["RoutingAttention", "update_routing"]

GATE_SHARPNESS = 8.0  # the gates are softmax(8 · cos(r_q, μ)) over the centroids: cosines lie in [-1, 1]
HANDOVER_PENALTY = 16.0  # nats at the hand-over's last step: an unrouted key then weighs e^-16 of a routed one


class RoutingAttention(Router):
    """Routing attention over (B, H, N, D) queries, keys and values: a ``Router`` that attends within its clusters.

    Args:
        heads, head_dim: H and D.
        num_clusters: k centroids per head (≈ sqrt(N) gives O(N^1.5 · D)).
        window: keys per query and probe: the most recent ``window`` keys of each probed cluster (causal), or the
            ``window`` nearest in the cluster's order (non-causal sorted), or the size of each balanced cluster.
        causal: a query sees only positions <= its own. Causal routing never lets a later token decide which
            earlier tokens share a cluster (the paper's balanced clusters would: they leak the future into the
            past); balance comes from the bias instead (``balance``).
        shared_qk: queries and keys are the same vectors (pass k = q): the routing vector of a position comes from
            q, and a query does not attend to its own key unless no other key is visible (q_i·k_i would dominate).
            With ``shared_qk=False`` each position routes on normalise(n(q_i) + n(k_i)), one cluster per position
            (the paper assumes W_Q ≈ W_K, so q_i and k_i point alike), and its own key is an ordinary key.
        balanced: non-causal only. True: the paper's balanced clusters (each centroid takes its ``window`` nearest
            tokens; a token in several clusters attends to the union of their keys, merged exactly; a token in
            none attends to the keys of its nearest centroid's cluster). False: the sorted window without the
            causal constraint. Default: True when non-causal.
        separate: causal, shared_qk=False: route queries by q and keys by k; a query probes the clusters nearest its
            query vector, a key joins the cluster of its key vector, so W_Q and W_K can learn to meet in a cluster as
            they meet in q·k.
        probes: causal: the clusters each query probes, p (``probes.py``); a query scores up to p · window keys.
        balance: causal: the step of the per-cluster bias that balances the clusters' loads between optimiser
            steps (``router.py``); 0 keeps the paper's plain argmax.
        warmup: causal: optimiser steps (``update`` calls) of dense causal attention first, while the k-means, the
            bias and the projections learn; then the layer routes. The counter is saved with the model.
        handover: causal: optimiser steps after the warm-up in which the heads still attend densely but with the
            scores of the keys routing would not score lowered by λ, growing linearly to ``HANDOVER_PENALTY`` at
            its last step (``handover_penalty``); then the layer routes. O(N²·D) like the warm-up.
        gate: causal: scale each probed cluster's softmax by the query's softmax over its centroid scores instead
            of one softmax over the union: a differentiable path into the routing.
        decay, commitment: k-means EMA decay λ and the commitment-loss weight β.
        seed: seed of the fixed random orthonormal routing projection W_R.
        backend: the executor of the attention ("auto": FlexAttention on CUDA, the fused kernels on the CPU;
            "fused", "tiles", "flex").

    After ``forward`` in training mode, ``commitment_loss`` holds β · mean ||r - sg(μ_c)||² for the training loss
    (None after a forward in evaluation mode, which needs no loss).
    Time O(N·k·D + N·p·window·D), memory O(N·k + N·p·window) per head; O(N²·D) during the warm-up.

    The routing (``projection`` W_R, ``kmeans``, the bias, ``route``, ``route_keys``, ``probe``, the statistics and
    the commitment loss) is the ``Router`` this class extends, so the state_dict keys are the router's own
    (``projection``, ``kmeans.*``, ``bias``) and, with a warm-up, ``steps``.
    """

    def __init__(self, heads: int, head_dim: int, num_clusters: int, window: int, causal: bool = True,
                 shared_qk: bool = True, balanced: bool | None = None, separate: bool = False, probes: int = 1,
                 balance: float = 0.0, warmup: int = 0, gate: bool = False, decay: float = 0.999,
                 commitment: float = 1e-4, seed: int = 0, backend: Backend = "auto", handover: int = 0) -> None:
        for name, value in (("heads", heads), ("head_dim", head_dim), ("num_clusters", num_clusters)):
            positive_int(name, value)  # checked here first, in the order of the arguments
        window = positive_int("window", window)
        causal = bool(causal)
        if balanced is None:
            balanced = not causal
        if balanced and causal:
            raise ValueError("balanced=True needs causal=False: balanced clusters pick their members using later "
                             "tokens, which leaks the future into the past")
        for name, value in (("warmup", warmup), ("handover", handover)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer (optimiser steps), got {value!r}")
        if not causal:
            given = [name for name, value, default in (("separate", separate, False), ("probes", probes, 1),
                                                      ("balance", balance, 0.0), ("warmup", warmup, 0),
                                                      ("handover", handover, 0), ("gate", gate, False))
                     if value != default]
            if given:
                raise ValueError(f"{', '.join(given)} apply to causal routing only (causal=True)")
        super().__init__(heads, head_dim, num_clusters, shared_qk=shared_qk, separate=separate, probes=probes,
                         balance=balance, decay=decay, commitment=commitment, seed=seed)
        self.window, self.causal, self.balanced = window, causal, bool(balanced)
        self.gate, self.warmup, self.handover = bool(gate), warmup, handover
        self.backend = executor_for(backend)  # resolved once; every path hands this executor on
        self._steps = 0  # a python mirror of `steps`: the forward decides without reading a tensor
        if warmup or handover:
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    # --- modes ----------------------------------------------------------------------------------------------
    @property
    def warming_up(self) -> bool:
        """Whether the layer still attends densely (its first ``warmup`` optimiser steps)."""
        return self._steps < self.warmup

    @property
    def handing_over(self) -> bool:
        """Whether the layer is in its hand-over (the ``handover`` steps after the warm-up)."""
        return self.warmup <= self._steps < self.warmup + self.handover

    @property
    def dense(self) -> bool:
        """Whether the forward attends to every earlier key (warm-up or hand-over): O(N²)."""
        return self._steps < self.warmup + self.handover

    def handover_penalty(self) -> float:
        """λ of the current hand-over step s (0 … handover - 1): HANDOVER_PENALTY · (s + 1) / handover."""
        return HANDOVER_PENALTY * (self._steps - self.warmup + 1) / self.handover

    @property
    def probing(self) -> bool:
        """Whether queries see more than their own cluster's window (``probes.py``), else the sorted window."""
        return self.probes > 1 or self.separate or self.gate

    def update(self, group: dist.ProcessGroup | None = None) -> None:
        """The k-means and bias step (``Router.update``), and one step of the warm-up's count."""
        super().update(group)
        if self.warmup or self.handover:
            self.steps += 1
            self._steps = int(self.steps)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.warmup or self.handover:
            self._steps = int(self.steps)

    def update_routing(self, group: dist.ProcessGroup | None = None) -> None:
        """The routing step of one optimiser step (``update``)."""
        self.update(group)

    # --- forward --------------------------------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
                key_padding_mask: Tensor | None = None, rel_pos: RelativePositions | None = None) -> Tensor:
        """(B, H, N, D) -> (B, H, N, D)."""
        _, _, _, _, scale, key_valid = check_inputs(q, k, v, scale, key_padding_mask, rel_pos)
        routes = self.routes(q, k, key_padding_mask, observe=True)
        executor = get_executor(self.backend, q.device)
        if self.dense:
            bias = self.handover_bias(routes, q.dtype) if self.handing_over else None
            return self._dense(q, k, v, scale, key_valid, rel_pos, bias)
        if self.probing:
            return probed_window_attention(q, k, v, routes.keys, routes.probes, window=self.window,
                                           exclude_self=self.shared_qk, scale=scale, executor=executor,
                                           key_valid=key_valid, rel_pos=rel_pos, gates=self._gates(routes))
        if self.balanced:
            members = balanced_members(routes.scores, self.window, key_padding_mask)
            return balanced_attention(q, k, v, members, routes.keys, exclude_self=self.shared_qk, scale=scale,
                                      key_valid=key_valid, rel_pos=rel_pos, backend=self.backend)
        return sorted_window_attention(q, k, v, routes.keys, window=self.window, causal=self.causal,
                                       exclude_self=self.shared_qk, scale=scale, key_valid=key_valid,
                                       rel_pos=rel_pos, backend=self.backend)

    def handover_bias(self, routes: Routes, dtype: torch.dtype) -> Tensor:
        """(B, H, N, N): 0 on the pairs routing scores (``routed_pairs``), -λ (``handover_penalty``) elsewhere."""
        routed = routed_pairs(routes.keys, routes.probes, self.window, self.num_clusters)
        return (~routed).to(dtype) * -self.handover_penalty()

    def _dense(self, q: Tensor, k: Tensor, v: Tensor, scale: float, key_valid: Tensor | None,
               rel_pos: RelativePositions | None, bias: Tensor | None = None) -> Tensor:
        """The warm-up and the hand-over: causal attention to every earlier key (shared QK: not the own key, unless
        alone), plus the hand-over's ``bias``, as one dense tile, O(N²) memory."""
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        restrict = KeyRestrictions(exclude_self=True) if self.shared_qk else None
        out, _ = get_executor(self.backend, q.device).tiled(q, k, v, Tiling.dense(n, allow=causal), scale=scale,
                                                            key_valid=key_valid, restrict=restrict,
                                                            rel_pos=rel_pos, distances=INDEX,
                                                            bias=None if bias is None else bias[:, :, None])
        return out

    def _gates(self, routes: Routes) -> Tensor | None:
        """(B, H, N, p): each probed cluster's share of the query's softmax over its centroid scores, with a
        gradient into the query's routing vector (the centroids stay out of it: k-means moves them)."""
        if not self.gate:
            return None
        scores = torch.einsum("bhnd,hkd->bhnk", routes.vectors, self.kmeans.centroids.to(routes.vectors.dtype))
        return (GATE_SHARPNESS * scores).softmax(-1).gather(-1, routes.probes)

    @torch.no_grad()
    def routing_mask(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """The exact boolean (B, H, N, N) mask ``forward`` computes, for tests, figures and analysis at small N.
        With gates the forward weighs the probes apart; the mask is still the union of what they see."""
        check_inputs(q, k, v=q, scale=None, key_padding_mask=key_padding_mask)
        routes = self.routes(q, k)
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]
        if self.dense:  # the hand-over's penalty weighs keys, it hides none
            n = q.shape[2]
            allow = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            allow = allow.expand(*q.shape[:2], n, n) if valid is None else allow & valid[:, :, None, :]
            return drop_own_key(allow, torch.eye(n, dtype=torch.bool, device=q.device)) if self.shared_qk else allow
        if self.probing:
            return probed_window_mask(routes.keys, routes.probes, self.window, self.shared_qk, valid)
        if self.balanced:
            members = balanced_members(routes.scores, self.window, key_padding_mask)
            return balanced_mask(members, routes.keys, self.shared_qk, valid)
        return sorted_window_mask(routes.keys, self.window, self.causal, self.shared_qk, valid)

    # --- decoding -------------------------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int | None, *, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float32) -> RoutingCache:
        """An empty decoding cache for up to ``max_len`` positions (causal only); None: the caller checks the
        length itself (as ``TransformerLM``'s cache does, once for every layer)."""
        if not self.causal:
            raise ValueError("incremental decoding needs causal=True")
        if self.dense:
            raise ValueError(f"this layer attends densely for {self.warmup + self.handover - self._steps} more "
                             f"optimiser steps (warmup={self.warmup}, handover={self.handover}); its cache is not "
                             f"the routed one: decode with a model's cache (TransformerLM.generate), which keeps "
                             f"every position during the warm-up")
        return RoutingCache.empty(batch, self.heads, self.num_clusters, self.window, self.head_dim,
                                  max_len=max_len, device=device or self.projection.device, dtype=dtype)

    @torch.no_grad()
    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache: RoutingCache, *, scale: float | None = None,
               rel_pos: RelativePositions | None = None) -> Tensor:
        """Outputs (B, H, n, D) of n new positions (B, H, n, D), continuing ``cache`` and updating it in place.

        Equal to the causal forward over the whole sequence at those positions. A new token costs
        O(k·D + p·window·D) per head whatever its position: it is routed, its key written to its cluster's ring
        buffer of the last ``window`` keys and values, and it attends over the buffers of the clusters it probes.
        A prompt given to an empty cache runs the forward once and fills the buffers in one pass.
        """
        _, _, n, D, scale, _ = check_inputs(q, k, v, scale, None, rel_pos)
        cache.check(n)
        if self.dense:
            raise ValueError("decode: this layer is in its dense warm-up or hand-over (see new_cache)")
        routes = self.routes(q, k)
        if cache.length == 0 and n > 1:  # a prompt: one forward, then every cluster's last `window` at once
            sort = sort_by_cluster(routes.keys, self.num_clusters)  # one sort for both
            executor = get_executor(self.backend, q.device)
            if self.probing:
                out = probed_window_attention(q, k, v, routes.keys, routes.probes, window=self.window,
                                              exclude_self=self.shared_qk, scale=scale, executor=executor,
                                              rel_pos=rel_pos, gates=self._gates(routes), sort=sort)
            else:
                out = sorted_window_attention(q, k, v, routes.keys, window=self.window, causal=True,
                                              exclude_self=self.shared_qk, scale=scale, rel_pos=rel_pos, sort=sort,
                                              backend=self.backend)
            cache.fill(k, v, sort)
            return out
        gates = self._gates(routes)
        outs = [cache.step(q[:, :, t], k[:, :, t], v[:, :, t], routes.keys[:, :, t], routes.probes[:, :, t],
                           scale=scale, exclude_self=self.shared_qk, rel_pos=rel_pos,
                           gates=None if gates is None else gates[:, :, t]) for t in range(n)]
        return torch.stack(outs, dim=2)

    def extra_repr(self) -> str:
        mode = "causal" if self.causal else ("balanced" if self.balanced else "sorted window")
        extra = "".join(f", {name}={value}" for name, value, default in
                        (("separate", self.separate, False), ("probes", self.probes, 1), ("balance", self.balance, 0.0),
                         ("warmup", self.warmup, 0), ("handover", self.handover, 0), ("gate", self.gate, False))
                        if value != default)
        return (f"heads={self.heads}, head_dim={self.head_dim}, num_clusters={self.num_clusters}, "
                f"window={self.window}, {mode}, shared_qk={self.shared_qk}{extra}, backend={self.backend.name}")
