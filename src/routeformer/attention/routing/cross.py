"""Routed cross-attention: queries of one sequence (a decoder's) read a memory's keys (an encoder's output) by cluster.

Every memory key j is in the cluster c(j) its routing vector is nearest (one cluster: the memory is sorted once);
every query i reads the p clusters P_1(i), …, P_p(i) nearest its own (``CrossRoutes``). The whole memory is visible
to every query, so each cluster is read as a balanced window: the memory sorted by (cluster, position), cluster c's
window is the ``window`` sorted keys from its first one on (all of c's keys when it has at most ``window``, then
the ones that follow it in the sort; its first ``window`` by position when it has more), moved back where it would
run past the last real key. Query i attends to the union of its probes' windows, one softmax (p windows that
overlap count each key once). ``window`` defaults to ceil(Nk / k), the paper's balanced size: p · Nk / k keys a
query, O(sqrt(Nk)) with k ~ sqrt(Nk).

Nothing about one query depends on another query: the sort is the memory's alone and a query's windows follow from
its own probes. A causal decoder that reads a memory this way cannot leak its future (unlike balancing over the
queries, which ranks a query against later ones). Padded memory keys (the inputs' key padding) sort after every real
key and fall in no window: the padding changes nothing.

Computed without an (Nq, Nk) matrix: the sorted memory is one copy (``KeyOrder``), each (query, probe) window a
contiguous range of it, and ``Executor.ranges`` attends the Nq · p entries, merging a query's p entries through their
log-sum-exp. Time O(Nq · p · (window + G) · D + Nk log Nk), memory O(Nq · p · (window + G)) per head.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ...checks import positive_int
from ...executors import Backend, get_executor
from ...executors.inputs import Inputs
from ...executors.ranges import KeyOrder, Ranges
from .kmeans import SphericalKMeans


class MemorySort(NamedTuple):
    """The memory sorted by (cluster, position), as an executor's router makes it: ``order``, ``inverse`` (B, H, Nk)
    (``k.gather(2, order)`` sorts) and ``counts`` (B, H, C) the clusters' sizes."""

    order: Tensor
    inverse: Tensor
    counts: Tensor


class CrossRoutes(NamedTuple):
    """How queries read a memory: ``keys`` (B, H, Nk) long, each memory key's cluster in [0, ``clusters``);
    ``probes`` (B, H, Nq, p) long, the distinct clusters each query reads, best first; ``sort`` the memory's sort
    where a router's kernel made it (else ``routing_cross_attention`` sorts)."""

    keys: Tensor
    probes: Tensor
    clusters: int
    sort: MemorySort | None = None


def cross_routes(q: Tensor, k: Tensor, centroids: Tensor, probes: int = 1, executor: Backend = "auto") -> CrossRoutes:
    """Route queries q (B, H, Nq, D) and memory keys k (B, H, Nk, D) by cosine to ``centroids`` (H, C, D): each key
    to its nearest centroid, each query to its ``probes`` nearest (best first). No gradient (a discrete choice).
    Through the ``executor``'s router kernel where it has one (``Executor.route_run``: no (N, C) scores, and the
    memory's sort comes with it), else PyTorch's scores. O((Nq + Nk) · C · D) per head."""
    H, C, D = centroids.shape
    if q.shape[1] != H or q.shape[3] != D or k.shape[1] != H or k.shape[3] != D:
        raise ValueError(f"centroids must be (H, C, D) with q's and k's H and D, got {tuple(centroids.shape)} for q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}")
    p = positive_int("probes", probes)
    if p > C:
        raise ValueError(f"probes ({p}) must be at most the number of centroids ({C})")
    with torch.no_grad():
        acc = torch.promote_types(q.dtype, torch.float32)
        mu = F.normalize(centroids.to(acc), dim=-1)
        rk, rq = (F.normalize(x.detach().to(acc), dim=-1) for x in (k, q))
        route = get_executor(executor, q.device).runner(rk).route_run
        memory = None if route is None else route(rk, mu, None, None, 1, False)
        asked = None if memory is None else route(rq, mu, None, None, p, False)
        if asked is not None:
            return CrossRoutes(memory.probes[..., 0], asked.probes, C,
                               MemorySort(memory.order, memory.inverse, memory.counts))
        key_scores = torch.einsum("bhnd,hcd->bhnc", rk, mu)
        query_scores = torch.einsum("bhnd,hcd->bhnc", rq, mu)
        return CrossRoutes(key_scores.argmax(-1), query_scores.topk(p, dim=-1).indices, C)


def default_window(memory: int, clusters: int) -> int:
    """The balanced window: ceil(Nk / C) keys a cluster (the bound of ``routing_cross_attention``'s ranges)."""
    return max(1, math.ceil(memory / clusters))


def routing_cross_attention(inputs: Inputs, routes: CrossRoutes, window: int | None = None,
                            executor: Backend = "auto") -> Tensor:
    """Each query over the union of its probes' windows of the sorted memory (see the module).

    ``inputs``: ``Inputs.cross(q, k, v, key_padding_mask=...)``, q (B, H, Nq, D) against the memory k, v
    (B, H, Nk, D); ``routes``: ``cross_routes`` or a router's; ``window`` keys a probe (None: ceil(Nk / C) for each
    row's Nk real keys).
    Returns (B, H, Nq, D), zeros for a query that sees no key (a memory of padding only). Gradients reach q, k and v
    (not the routes). Time O(Nq · p · window · D + Nk log Nk) per head.
    """
    q, k = inputs.q, inputs.k
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    keys, probes, clusters, sort = routes
    if tuple(keys.shape) != (B, H, Nk) or probes.dim() != 4 or tuple(probes.shape[:3]) != (B, H, Nq):
        raise ValueError(f"routes: keys must be (B, H, Nk) = {(B, H, Nk)} and probes (B, H, Nq, p) with (B, H, Nq) = "
                         f"{(B, H, Nq)}, got keys {tuple(keys.shape)} and probes {tuple(probes.shape)}")
    bound = min(Nk, default_window(Nk, clusters) if window is None else positive_int("window", window))
    p = probes.shape[-1]
    pos = torch.arange(Nk, device=k.device)
    valid = inputs.key_valid  # (B, 1, Nk) or None
    if sort is not None and valid is None:  # the router kernel's sort
        order, inverse, counts = sort
    else:
        labels = keys if valid is None else torch.where(valid, keys, clusters)  # padding: one cluster past the last
        order = (labels * Nk + pos).argsort(-1)  # (B, H, Nk): by (cluster, position)
        inverse = torch.empty_like(order).scatter_(-1, order, pos.expand_as(order))
        counts = torch.zeros(B, H, clusters + 1, dtype=torch.long, device=k.device)
        counts.scatter_add_(-1, labels, torch.ones_like(labels))
    first = counts.cumsum(-1) - counts  # (B, H, C or C + 1): each cluster's first sorted key
    real = pos.new_full((1, 1, 1, 1), Nk) if valid is None else valid.sum(-1, keepdim=True)[..., None]  # real keys
    w = torch.clamp((real + clusters - 1) // clusters, min=1) if window is None else real.clamp(max=bound)
    lo = torch.minimum(first.gather(-1, probes.reshape(B, H, Nq * p)).view(B, H, Nq, p), real - w).clamp(min=0)
    hi = torch.minimum(lo + w, real)  # (B, H, Nq, p): each probe's window of the sorted memory
    lo, at = lo.sort(-1)  # the windows by start: each begins where those before it ended (a key counts once)
    hi = hi.gather(-1, at)
    ended = F.pad(hi.cummax(-1).values[..., :-1], (1, 0))
    lo = torch.maximum(lo, ended)
    hi = torch.maximum(hi, lo)
    spans = Ranges(lo.reshape(B, H, Nq * p), hi.reshape(B, H, Nq * p), width=bound, merge=p)
    return get_executor(executor, q.device).ranges(inputs, spans, order=KeyOrder(order, inverse))[0]


def routing_cross_mask(routes: CrossRoutes, window: int | None = None,
                       key_padding_mask: Tensor | None = None) -> Tensor:
    """What ``routing_cross_attention`` means, written apart from it: (B, H, Nq, Nk) bool, True where query i reads
    memory key j. Each real key's place in the (cluster, position) order counted from pairwise comparisons, each
    probe's window the places [min(first, real - window) clamped at 0, + window). O(Nq · Nk · p) memory."""
    keys, probes, clusters, _ = routes
    B, H, Nk = keys.shape
    real = torch.ones(B, Nk, dtype=torch.bool, device=keys.device) if key_padding_mask is None else key_padding_mask
    real = real[:, None, :]  # (B, 1, Nk)
    count = real.sum(-1, keepdim=True)  # (B, 1, 1)
    w = torch.ceil(count / clusters).long().clamp(min=1) if window is None else torch.clamp(count, max=window)
    pos = torch.arange(Nk, device=keys.device)
    before = (keys[..., None, :] < keys[..., :, None]) | (
        (keys[..., None, :] == keys[..., :, None]) & (pos[None, :] < pos[:, None]))  # [j, j']: j' sorts before j
    place = (before & real[..., None, :]).sum(-1)  # (B, H, Nk): real keys sorting before each key
    allowed = torch.zeros(*probes.shape[:3], Nk, dtype=torch.bool, device=keys.device)
    for t in range(probes.shape[-1]):
        c = probes[..., t]  # (B, H, Nq)
        first = ((keys[..., None, :] < c[..., None]) & real[..., None, :]).sum(-1)  # real keys of lower clusters
        lo = torch.minimum(first, count - w).clamp(min=0)[..., None]
        allowed |= (place[..., None, :] >= lo) & (place[..., None, :] < lo + w[..., None]) & real[..., None, :]
    return allowed



class RoutedCrossHeads(nn.Module):
    """Routed cross-attention heads with their own online spherical k-means (a decoder layer's, over the memory an
    encoder made): q (B, h, Nq, D) over the memory ``Inputs.cross(q, k, v, key_padding_mask=...)`` ->
    (B, h, Nq, D), ``routing_cross_attention`` under ``cross_routes`` to the centroids.

    The centroids follow the memory's real keys alone (their unit vectors' statistics, observed in a training
    forward and applied by ``after_optimizer_step``, all-reduced across ranks: ``SphericalKMeans``); padded memory
    keys move nothing. In training the commitment term β · mean ||r - sg(μ_c)||² of the real keys and of the queries
    (each to its first probe: pulling the queries towards the keys' clusters, as separate self-routing does) is
    ``aux_loss()``. Nothing a query reads depends on another query. Time O((Nq + Nk) · C · D + Nq · p · window · D)
    per head.
    """

    def __init__(self, heads: int, head_dim: int, num_clusters: int, *, probes: int = 1, window: int | None = None,
                 decay: float = 0.999, commitment: float = 1e-4) -> None:
        super().__init__()
        self.heads, self.head_dim = positive_int("heads", heads), positive_int("head_dim", head_dim)
        self.kmeans = SphericalKMeans(heads, head_dim, num_clusters, decay=decay)
        self.probes = positive_int("probes", probes)
        if self.probes > num_clusters:
            raise ValueError(f"probes ({probes}) must be at most num_clusters ({num_clusters})")
        self.window = None if window is None else positive_int("window", window)
        self.commitment = float(commitment)
        self.executor: Backend = "auto"  # a model sets its device's
        self.commitment_loss: Tensor | None = None

    def routes(self, q: Tensor, k: Tensor) -> CrossRoutes:
        """The memory keys' clusters and the queries' probes under the current centroids (no gradient)."""
        return cross_routes(q, k, self.kmeans.centroids, self.probes, self.executor)

    def forward(self, inputs: Inputs) -> Tensor:
        if not inputs.is_cross:
            raise ValueError("RoutedCrossHeads reads a memory: give Inputs.cross(q, k, v, key_padding_mask=...)")
        q, k = inputs.q, inputs.k
        routes = self.routes(q, k)
        valid = None if inputs.key_valid is None else inputs.key_valid[:, 0]  # (B, Nk): the real memory keys
        if self.training:
            acc = torch.promote_types(q.dtype, torch.float32)
            rk, rq = (F.normalize(x.to(acc), dim=-1) for x in (k, q))  # with their gradient, for the commitment
            self.kmeans.observe(rk.detach(), routes.keys, valid)
            seen = None if valid is None else torch.cat([valid, valid.new_ones(q.shape[0], q.shape[2])], 1)
            self.commitment_loss = self.commitment * self.kmeans.commitment(
                torch.cat([rk, rq], 2), torch.cat([routes.keys, routes.probes[..., 0]], 2), seen)
        else:
            self.commitment_loss = None
        return routing_cross_attention(inputs, routes, self.window, self.executor)

    def aux_loss(self) -> Tensor | None:
        return self.commitment_loss

    def after_optimizer_step(self, step: int | None = None, group: dist.ProcessGroup | None = None) -> bool:
        """The k-means step (call after each ``optimizer.step()`` on every rank)."""
        self.kmeans.update(group)
        return True

    def replicated_state(self) -> dict[str, Tensor]:
        """The buffers every rank must hold bit-identical: the centroids and their running statistics."""
        return {f"kmeans.{name}": buf for name, buf in self.kmeans.named_buffers() if not name.startswith("pending")}

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, num_clusters={self.kmeans.num_clusters}, "
                f"probes={self.probes}, window={self.window}")


__all__ = ["CrossRoutes", "MemorySort", "RoutedCrossHeads", "cross_routes", "default_window", "routing_cross_attention",
           "routing_cross_mask"]
