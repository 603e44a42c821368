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

Centroids and the balancing bias move only in ``update()`` / ``update_routing()`` (see ``kmeans.py`` and
``router.py``). ``RoutingAttention`` is the routing head group of a model and a module of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ...documents import DocumentSpans
from ...executors import KeyRestrictions, RelativePositions, Tiling, Window, check_inputs
from ...executors.inputs import Inputs, relative
from ..decoding import seen
from ..kinds.base import HeadGroup, KeyStore
from ..reference import reference_attention
from .balanced import balanced_attention, balanced_mask, balanced_members, balanced_over_documents
from .cache import RoutingCache, TokenRoute
from .options import RoutingOptions, read_option
from .probes import probe_masks, probed_window_attention, probed_window_mask, routed_pairs
from .router import Router, Routes, update_routing
from .sorted_window import ClusterOrder, drop_own_key, sort_by_cluster, sorted_window_attention, sorted_window_mask

__all__ = ["RoutingAttention", "update_routing"]

GATE_SHARPNESS = 8.0  # the gates are softmax(8 · cos(r_q, μ)) over the centroids: cosines lie in [-1, 1]
HANDOVER_PENALTY = 16.0  # nats at the hand-over's last step: an unrouted key then weighs e^-16 of a routed one


class RoutingAttention(HeadGroup):
    """Routing attention over (B, H, N, D) queries, keys and values: heads that attend within the clusters their
    ``Router`` (``routing``) assigns; a model's routing head group, and a module of its own.

    Args:
        heads, head_dim: H and D.
        options: ``RoutingOptions`` (``options.py``) with ``num_clusters`` and ``window`` given (a model completes
            them from seq_len): k centroids per head (≈ sqrt(N) gives O(N^1.5 · D)); keys per query and probe (the
            most recent ``window`` keys of each probed cluster when causal, the ``window`` nearest in the cluster's
            order when non-causal sorted, the size of each balanced cluster); shared QK, separate routing, probes,
            the balancing bias, the dense warm-up and hand-over, gates, the k-means decay and the commitment weight
            (see ``RoutingOptions``; all but num_clusters, window, shared_qk, decay and commitment are causal
            only).
        causal: a query sees only positions <= its own. Causal routing never lets a later token decide which
            earlier tokens share a cluster (the paper's balanced clusters would: they leak the future into the
            past); balance comes from the bias instead (``balance``).
        balanced: non-causal only. True: the paper's balanced clusters (each centroid takes its ``window`` nearest
            tokens; a token in several clusters attends to the union of their keys, merged exactly; a token in
            none attends to the keys of its nearest centroid's cluster). False: the sorted window without the
            causal constraint. Default: True when non-causal.
        seed: seed of the fixed random orthonormal routing projection W_R.

    With shared QK pass k = q: a query then does not attend to its own key unless no other key is visible. The
    executor is ``self.executor`` (a model sets its device's; standalone, the CPU's).

    After ``forward`` in training mode, ``commitment_loss`` holds β · mean ||r - sg(μ_c)||² for the training loss
    (None after a forward in evaluation mode, which needs no loss). ``update()`` after each optimiser step moves
    the centroids and the bias and counts the warm-up.
    Time O(N·k·D + N·p·window·D), memory O(N·k + N·p·window) per head; O(N²·D) during the warm-up.

    State: the router's (``routing.projection``, ``routing.kmeans.*``, ``routing.bias`` and, with a warm-up,
    ``routing.steps``).
    """

    def __init__(self, heads: int, head_dim: int, options: RoutingOptions, *, causal: bool = True,
                 balanced: bool | None = None, seed: int = 0) -> None:
        if not isinstance(options, RoutingOptions):
            raise ValueError(f"options must be RoutingOptions, got {type(options).__name__}")
        o = options
        for name in ("num_clusters", "window"):
            if getattr(o, name) is None:
                raise ValueError(f"options.{name} must be given for a layer outside a model (a model derives it "
                                 f"from seq_len)")
        causal = bool(causal)
        if balanced is None:
            balanced = not causal
        if balanced and causal:
            raise ValueError("balanced=True needs causal=False: balanced clusters pick their members using later "
                             "tokens, which leaks the future into the past")
        if not causal:
            given = [name for name, value, default in (("separate", o.separate, False), ("probes", o.probes, 1),
                                                      ("balance", o.balance, 0.0), ("warmup", o.warmup, 0),
                                                      ("handover", o.handover, 0), ("gate", o.gate, False))
                     if value != default]
            if given:
                raise ValueError(f"{', '.join(given)} apply to causal routing only (causal=True)")
        super().__init__(heads, head_dim)
        self.routing = Router(heads, head_dim, o, seed=seed, counted=bool(o.warmup or o.handover))
        self.options = o  # every routing setting is read from here (the router holds the same value)
        self.causal, self.balanced = causal, bool(balanced)

    # --- the options, read where they are kept ----------------------------------------------------------------
    num_clusters = read_option("num_clusters")
    window = read_option("window")
    probes = read_option("probes")
    shared_qk = read_option("shared_qk")
    separate = read_option("separate")
    gate = read_option("gate")
    warmup = read_option("warmup")
    handover = read_option("handover")

    # --- modes ----------------------------------------------------------------------------------------------
    @property
    def _steps(self) -> int:
        return self.routing.updates

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

    # --- learning outside the gradient ------------------------------------------------------------------------
    @property
    def commitment_loss(self) -> Tensor | None:
        """β · mean ||r - sg(μ_c)||² of the last training forward (None after an evaluation forward)."""
        return self.routing.commitment_loss

    def aux_loss(self) -> Tensor | None:
        return self.routing.commitment_loss

    def update(self, group: dist.ProcessGroup | None = None) -> None:
        """The k-means and bias step (``Router.update``), and one step of the warm-up's count; once per optimiser
        step, on every rank."""
        self.routing.update(group)

    def after_optimizer_step(self, step: int | None, group: dist.ProcessGroup | None) -> bool:
        self.update(group)
        return True

    def replicated_state(self) -> dict[str, Tensor]:
        return {f"routing.{name}": buf for name, buf in self.routing.named_buffers() if "pending" not in name}

    # --- forward --------------------------------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None = None, *,
                scale: float | None = None, key_padding_mask: Tensor | None = None,
                documents: Tensor | None = None) -> Tensor:
        """(B, H, N, D) -> (B, H, N, D). ``documents`` (B, N): packed documents, a query seeing only its own
        document's keys: each cluster's window within the document (the label is (document, cluster)), the dense
        warm-up within it; balanced clusters within each document, as if it were alone; the k-means statistics are
        those of the positions as they are, however packed."""
        inputs = check_inputs(q, k, v, scale, key_padding_mask, rel_pos, documents=documents)
        # balanced clusters read the scores only over packed documents (their tiers); else the router's kernel
        # routes and ``Router.members`` scores a few clusters at a time: no (B, H, N, k) scores
        routes = self.routing.routes(q, k, key_padding_mask, observe=True,
                                     need_scores=self.balanced and documents is not None, executor=self.executor)
        o, ex = self.options, self.executor
        if self.dense:
            bias = self.handover_bias(routes, q.dtype) if self.handing_over else None
            return self._dense(inputs, rel_pos, bias)
        if self.probing:
            return probed_window_attention(inputs, routes.keys, routes.probes, o,
                                           sort=self._sort(routes, inputs.documents),
                                           executor=ex, rel_pos=rel_pos, gates=self._gates(routes))
        if self.balanced:
            if inputs.documents is not None:
                return balanced_over_documents(inputs, routes.scores, routes.keys, o, window=self.window, executor=ex,
                                               rel_pos=rel_pos)
            members = self.routing.members(routes.vectors, self.window, key_padding_mask)
            return balanced_attention(inputs, members, routes.keys, o, executor=ex, rel_pos=rel_pos)
        return sorted_window_attention(inputs, self._sort(routes, inputs.documents), o, executor=ex,
                                       causal=self.causal, rel_pos=rel_pos)

    def _sort(self, routes: Routes, documents: Tensor | None = None) -> ClusterOrder:
        """The keys sorted by (cluster, position): the router's where its kernel made it, else made here (with the
        clusters' sizes where the probes' ranges start from them). With packed ``documents`` (B, N) by (document,
        cluster, position): each document's entries then hold the same places of the sorted sequence whatever the
        other documents route to, so that the executor's tiles, and their rounding, are the same for it."""
        if documents is not None:
            return sort_by_cluster(documents[:, None, :] * self.num_clusters + routes.keys)
        if routes.sort is not None:
            return routes.sort
        return sort_by_cluster(routes.keys, self.num_clusters if self.probing else None)

    def handover_bias(self, routes: Routes, dtype: torch.dtype) -> Tensor:
        """(B, H, N, N): 0 on the pairs routing scores (``routed_pairs``), -λ (``handover_penalty``) elsewhere."""
        routed = routed_pairs(routes.keys, routes.probes, self.window, self.num_clusters)
        return (~routed).to(dtype) * -self.handover_penalty()

    def _dense(self, inputs: Inputs, rel_pos: RelativePositions | None, bias: Tensor | None = None) -> Tensor:
        """The warm-up and the hand-over: causal attention to every earlier key (shared QK: not the own key, unless
        alone), plus the hand-over's ``bias``, as one dense tile, O(N²) memory. Causal as a window of every key
        (the offsets j - i <= 0), not a mask tensor: an executor reads the range from the tiling, with no host read
        of a device tensor."""
        n = inputs.q.shape[2]
        restrict = KeyRestrictions(exclude_self=True) if self.shared_qk else None
        out, _ = self.executor.tiled(inputs, Tiling(block=n, window=Window(n, causal=True)),
                                     restrict=restrict, rel=relative(rel_pos),
                                     bias=None if bias is None else bias[:, :, None])
        return out

    def _gates(self, routes: Routes) -> Tensor | None:
        """(B, H, N, p): each probed cluster's share of the query's softmax over its centroid scores, with a
        gradient into the query's routing vector (the centroids stay out of it: k-means moves them)."""
        if not self.gate:
            return None
        centroids = self.routing.kmeans.centroids.to(routes.vectors.dtype)
        scores = torch.einsum("bhnd,hkd->bhnk", routes.vectors, centroids)
        return (GATE_SHARPNESS * scores).softmax(-1).gather(-1, routes.probes)

    # --- meaning, for tests and analysis ----------------------------------------------------------------------
    @torch.no_grad()
    def routing_mask(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """The exact boolean (B, H, N, N) mask ``forward`` computes, for tests, figures and analysis at small N.
        With gates the forward weighs the probes apart; the mask is still the union of what they see."""
        check_inputs(q, k, v=q, scale=None, key_padding_mask=key_padding_mask)
        routes = self.routing.routes(q, k)
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

    def reference_mask(self, q: Tensor, k: Tensor) -> Tensor:
        return self.routing_mask(q, k)

    def reference_bias(self, q: Tensor, k: Tensor) -> Tensor | None:
        """The hand-over: every earlier key, the unrouted ones lowered by the penalty."""
        return self.handover_bias(self.routing.routes(q, k), q.dtype) if self.handing_over else None

    def reference(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None = None) -> Tensor:
        if self.gate and not self.dense:  # the probes' softmaxes weighed by the gates
            routes = self.routing.routes(q, k)
            masks = probe_masks(routes.keys, routes.probes, self.window)  # (B, h, p, N, N)
            if self.shared_qk:  # the own key only where the union holds nothing else
                eye = torch.eye(q.shape[2], dtype=torch.bool, device=q.device)
                masks = masks & ~(eye & (masks.any(2) & ~eye).any(-1, keepdim=True))[:, :, None]
            gates = self._gates(routes)
            inputs = Inputs.of(q, k, v, scale=self.scale)
            return sum(gates[:, :, :, t, None] * reference_attention(inputs, masks[:, :, t], rel=rel_pos)
                       for t in range(self.probes))
        return super().reference(q, k, v, rel_pos)

    def clusters(self, q: Tensor, k: Tensor) -> Tensor:
        return self.routing.route(q, k)

    @torch.no_grad()
    def reach(self, q: Tensor, k: Tensor, rows: Tensor, cols: Tensor, sources: Tensor) -> dict[str, Tensor]:
        """Cluster balance (keys in the largest cluster / mean), and for each probe t how often the key at
        ``sources`` is in cluster t of the query at (``rows``, ``cols``) and within its window there (scalars over
        the heads; ``in_cluster`` and ``in_window`` over all probes)."""
        routes = self.routing.routes(q, k)
        sizes = F.one_hot(routes.keys, self.num_clusters).sum(2).float()  # (B, H, k) keys per cluster
        home = routes.keys[rows, :, sources]  # (S, H): the cluster of each needed key
        hit = routes.probes[rows, :, cols] == home[..., None]  # (S, H, p)
        windows = probe_masks(routes.keys, routes.probes, self.window)[rows, :, :, cols, sources]  # (S, H, p)
        out = {"balance": (sizes.max(-1).values / sizes.mean(-1)).mean(),
               "in_cluster": hit.any(-1).float().mean(), "in_window": windows.any(-1).float().mean()}
        for t in range(self.probes):
            out[f"in_cluster_{t + 1}"] = hit[..., t].float().mean()
            out[f"in_window_{t + 1}"] = windows[..., t].float().mean()
        return out

    # --- decoding -------------------------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int | None, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float32) -> RoutingCache | KeyStore:
        """An empty decoding cache for up to ``max_len`` positions (causal only): the per-cluster ring buffers, or
        during the warm-up and hand-over every position (``HeadGroup``'s store; ``max_len`` needed then)."""
        if not self.causal:
            raise ValueError("incremental decoding needs causal=True")
        if self.handing_over and not self.shared_qk:
            raise ValueError("decoding during the routing hand-over needs shared_qk = true (a key's cluster then "
                             "comes from the cached key alone); decode before or after the hand-over")
        device = device or self.routing.projection.device
        if self.dense:
            if max_len is None:
                raise ValueError(f"this layer attends densely for {self.warmup + self.handover - self._steps} more "
                                 f"optimiser steps (warmup={self.warmup}, handover={self.handover}): its cache keeps "
                                 f"every position, so it needs max_len")
            return super().new_cache(batch, max_len, device, dtype)
        return RoutingCache.empty(batch, self.heads, self.num_clusters, self.window, self.head_dim,
                                  max_len=max_len, device=device, dtype=dtype)

    def step(self, q: Tensor, cache: KeyStore, t: int, rel_pos: RelativePositions | None,
             since: Tensor | None = None) -> Tensor:
        """The warm-up and hand-over's decoding step: every earlier key (with packed documents, of the query's
        document, from ``since`` (B,) on); shared QK: its own only at the document's first position."""
        keys, values, positions = cache.filled()
        first = 0 if since is None else since[:, None, None]  # (B, 1, 1)
        allowed = (positions < t) | (positions == first) if self.shared_qk else None
        bias = self._handover_row(q, keys) if self.handing_over else None
        return self.attend(q, keys, values, positions, t, rel_pos, allowed=seen(positions, since, allowed), bias=bias)

    def _handover_row(self, q: Tensor, keys: Tensor) -> Tensor:
        """(B, h, M): the hand-over's penalty of the query at t on the cached keys (positions 0 … t, in order): row
        t of ``handover_bias``."""
        clusters = self.routing.routes(keys, keys).keys  # (B, h, M): shared QK, a key routes as the query it was
        probes = self.routing.routes(q[:, :, None], q[:, :, None]).probes[:, :, 0]  # (B, h, p)
        member = F.one_hot(clusters, self.num_clusters)
        newer = member.flip(2).cumsum(2).flip(2).gather(-1, clusters[..., None])[..., 0] - 1  # same cluster, in (j, t]
        routed = (clusters[..., None] == probes[:, :, None, :]).any(-1) & (newer < self.window)
        return (~routed).to(q.dtype) * -self.handover_penalty()

    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache: RoutingCache | KeyStore, start: int | None = None,
               rel_pos: RelativePositions | None = None, *, scale: float | None = None,
               spans: DocumentSpans | None = None) -> Tensor:
        """Outputs (B, H, n, D) of n new positions (B, H, n, D), continuing ``cache`` and updating it in place.

        Equal to the causal forward over the whole sequence at those positions. A new token costs
        O(k·D + p·window·D) per head whatever its position: it is routed, its key written to its cluster's ring
        buffer of the last ``window`` keys and values, and it attends over the buffers of the clusters it probes.
        A prompt given to an empty cache runs the forward once and fills the buffers in one pass. During the
        warm-up and hand-over every earlier key (``start``: the position of the first new one, default the count
        the cache holds). ``spans``: packed documents of the new positions (``documents.continue_documents``).
        """
        if isinstance(cache, KeyStore):  # every position, as HeadGroup keeps them
            return super().decode(q, k, v, cache, cache.count if start is None else start, rel_pos, spans)
        return self._decode_routed(q, k, v, cache, rel_pos, scale, spans)

    @torch.no_grad()
    def _decode_routed(self, q: Tensor, k: Tensor, v: Tensor, cache: RoutingCache, rel_pos: RelativePositions | None,
                       scale: float | None, spans: DocumentSpans | None = None) -> Tensor:
        """``decode`` on the per-cluster ring buffers. With packed documents (``spans``) a prompt's forward sorts by
        (document, cluster) and fills the rings as without; each step then reads only the entries from its row's
        document's start (``RoutingCache.step``)."""
        numbered = None if spans is None else spans.numbered
        inputs = check_inputs(q, k, v, scale, None, rel_pos, documents=numbered)
        n, scale = q.shape[2], inputs.scale
        cache.check(n)
        if self.dense:
            raise ValueError("decode: this layer is in its dense warm-up or hand-over; its cache is not the routed "
                             "one (make a new one with new_cache)")
        routes = self.routing.routes(q, k)
        if cache.length == 0 and n > 1:  # a prompt: one forward, then every cluster's last `window` at once
            sort = sort_by_cluster(routes.keys, self.num_clusters)  # one sort for both (without documents)
            within = sort if inputs.documents is None else self._sort(routes, inputs.documents)
            if self.probing:
                out = probed_window_attention(inputs, routes.keys, routes.probes, self.options, sort=within,
                                              executor=self.executor, rel_pos=rel_pos, gates=self._gates(routes))
            else:
                out = sorted_window_attention(inputs, within, self.options, executor=self.executor, rel_pos=rel_pos)
            cache.fill(k, v, sort)
            return out
        gates = self._gates(routes)
        outs = [cache.step(q[:, :, t], k[:, :, t], v[:, :, t],
                           TokenRoute(routes.keys[:, :, t], routes.probes[:, :, t],
                                      None if gates is None else gates[:, :, t]),
                           scale=scale, exclude_self=self.shared_qk, rel_pos=rel_pos,
                           since=None if spans is None else spans.since[:, t]) for t in range(n)]
        return torch.stack(outs, dim=2)

    def extra_repr(self) -> str:
        mode = "causal" if self.causal else ("balanced" if self.balanced else "sorted window")
        extra = "".join(f", {name}={value}" for name, value, default in
                        (("separate", self.separate, False), ("probes", self.probes, 1),
                         ("balance", self.options.balance, 0.0), ("warmup", self.warmup, 0),
                         ("handover", self.handover, 0), ("gate", self.gate, False))
                        if value != default)
        return (f"heads={self.heads}, head_dim={self.head_dim}, num_clusters={self.num_clusters}, "
                f"window={self.window}, {mode}, shared_qk={self.shared_qk}{extra}, executor={self.executor.name}")
