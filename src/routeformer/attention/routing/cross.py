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
from ...documents import CrossDocuments
from ...executors import Backend, get_executor
from ...executors.inputs import Inputs, refuse_cross_documents
from ...executors.ranges import KeyOrder, Ranges
from ..full import full_attention
from ..kinds.common import non_negative_int
from .kmeans import SphericalKMeans
from .sorted_window import sort_by_cluster


class MemorySort(NamedTuple):
    """The memory sorted by (document, cluster, position): ``order``, ``inverse`` (B, H, Nk) (``k.gather(2, order)``
    sorts), ``counts`` (B, H, P · C, or P · C + 1 with padding: the padded keys as one cluster past the last, sorted
    after every real key), ``padded``, whether it was made for a memory with padding, and ``documents``, the P
    packed documents of the widest row it was made for (1: none; ``sort_memory``)."""

    order: Tensor
    inverse: Tensor
    counts: Tensor
    padded: bool = False
    documents: int = 1


class CrossRoutes(NamedTuple):
    """How queries read a memory: ``keys`` (B, H, Nk) long, each memory key's cluster in [0, ``clusters``);
    ``probes`` (B, H, Nq, p) long, the distinct clusters each query reads, best first; ``sort`` the memory's sort
    (``sort_memory``, or a router kernel's), made once for the memory and its padding (None: made by
    ``routing_cross_attention``)."""

    keys: Tensor
    probes: Tensor
    clusters: int
    sort: MemorySort | None = None


def _routing_inputs(x: Tensor, centroids: Tensor, executor: Backend) -> tuple[Tensor, Tensor, object]:
    """Unit routing vectors of x (B, H, N, D) and unit centroids, in float32 or wider, and the executor's router
    kernel (``Executor.route_run``) or None."""
    acc = torch.promote_types(x.dtype, torch.float32)
    r = F.normalize(x.detach().to(acc), dim=-1)
    return r, F.normalize(centroids.detach().to(acc), dim=-1), get_executor(executor, x.device).runner(r).route_run


def _check_centroids(x: Tensor, centroids: Tensor, what: str) -> int:
    H, C, D = centroids.shape
    if x.shape[1] != H or x.shape[3] != D:
        raise ValueError(f"centroids must be (H, C, D) with {what}'s H and D, got {tuple(centroids.shape)} for "
                         f"{what} {tuple(x.shape)}")
    return C


@torch.no_grad()
def route_memory(k: Tensor, centroids: Tensor, executor: Backend = "auto", key_padding_mask: Tensor | None = None,
                 documents: Tensor | None = None) -> tuple[Tensor, MemorySort]:
    """Each memory key k (B, H, Nk, D) to its nearest centroid (H, C, D) by cosine, and the memory sorted by
    (document, cluster, position), its padding (B, Nk; True = real) after every real key: once per memory (a
    decoder's cross heads keep it for every decoded token). ``documents``: the memory's (B, Nk) packed documents,
    numbered from 0 (``CrossDocuments.memory`` as checked). The executor's router kernel where it has one and there
    is neither padding nor documents (its sort comes with it), else PyTorch's scores and sort. O(Nk · C · D +
    Nk log Nk) per head."""
    C = _check_centroids(k, centroids, "k")
    rk, mu, route = _routing_inputs(k, centroids, executor)
    plain = key_padding_mask is None and documents is None
    got = None if route is None or not plain else route(rk, mu, None, None, 1, False)
    if got is not None:
        return got.probes[..., 0], MemorySort(got.order, got.inverse, got.counts)
    keys = torch.einsum("bhnd,hcd->bhnc", rk, mu).argmax(-1)
    return keys, sort_memory(keys, C, key_padding_mask, documents)


def sort_memory(keys: Tensor, clusters: int, key_padding_mask: Tensor | None = None,
                documents: Tensor | None = None) -> MemorySort:
    """The memory's keys (B, H, Nk) in [0, clusters) sorted by (document, cluster, position): the label document ·
    clusters + cluster for (B, Nk) ``documents`` numbered from 0 (None: one a row), padded keys
    (``key_padding_mask`` (B, Nk) False) as one label past the last. O(Nk log Nk) per head."""
    padded = key_padding_mask is not None
    count = 1 if documents is None else int(documents.max()) + 1
    labels = keys if documents is None else documents[:, None, :] * clusters + keys
    if padded:
        labels = torch.where(key_padding_mask[:, None, :], labels, count * clusters)
    sort = sort_by_cluster(labels, count * clusters + padded)
    return MemorySort(sort.order, sort.inverse, sort.counts, padded, count)


@torch.no_grad()
def route_queries(q: Tensor, centroids: Tensor, probes: int = 1, executor: Backend = "auto") -> Tensor:
    """The ``probes`` centroids (H, C, D) nearest each query q (B, H, Nq, D) by cosine, best first: (B, H, Nq, p)
    long. The executor's router kernel where it has one. O(Nq · C · D) per head."""
    C = _check_centroids(q, centroids, "q")
    p = positive_int("probes", probes)
    if p > C:
        raise ValueError(f"probes ({p}) must be at most the number of centroids ({C})")
    rq, mu, route = _routing_inputs(q, centroids, executor)
    got = None if route is None else route(rq, mu, None, None, p, False)
    return got.probes if got is not None else torch.einsum("bhnd,hcd->bhnc", rq, mu).topk(p, dim=-1).indices


def cross_routes(q: Tensor, k: Tensor, centroids: Tensor, probes: int = 1, executor: Backend = "auto",
                 key_padding_mask: Tensor | None = None, documents: Tensor | None = None) -> CrossRoutes:
    """Route queries q (B, H, Nq, D) and memory keys k (B, H, Nk, D) by cosine to ``centroids`` (H, C, D): each key
    to its nearest centroid and the memory sorted (``route_memory``, with its padding (B, Nk) and its documents
    (B, Nk), numbered from 0), each query to its ``probes`` nearest (``route_queries``). No gradient (a discrete
    choice). Through the ``executor``'s router kernel where it has one (no (N, C) scores). O((Nq + Nk) · C · D) per
    head."""
    probes_of = route_queries(q, centroids, probes, executor)
    keys, sort = route_memory(k, centroids, executor, key_padding_mask, documents)
    return CrossRoutes(keys, probes_of, centroids.shape[1], sort)


def default_window(memory: int, clusters: int) -> int:
    """The balanced window: ceil(Nk / C) keys a cluster (the bound of ``routing_cross_attention``'s ranges)."""
    return max(1, math.ceil(memory / clusters))


def _with(padded: bool, documents: bool) -> str:
    """'with padding and documents', 'with padding', ... 'without padding or documents'."""
    given = [name for name, yes in (("padding", padded), ("documents", documents)) if yes]
    return f"with {' and '.join(given)}" if given else "without padding or documents"


def routing_cross_attention(inputs: Inputs, routes: CrossRoutes, window: int | None = None,
                            executor: Backend = "auto") -> Tensor:
    """Each query over the union of its probes' windows of the sorted memory (see the module).

    ``inputs``: ``Inputs.cross(q, k, v, key_padding_mask=..., documents=...)``, q (B, H, Nq, D) against the memory
    k, v (B, H, Nk, D); ``routes``: ``cross_routes`` or a router's; ``window`` keys a probe (None: ceil(n / C) for
    the n real keys of each row, or of the query's document where the inputs pack documents: a query then reads
    its own document's keys only, sorted as if that document were alone).
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
    valid = inputs.key_valid  # (B, 1, Nk) or None
    docs = inputs.cross_documents
    if sort is None:
        sort = sort_memory(keys, clusters, None if valid is None else valid[:, 0],
                           None if docs is None else docs.memory)
    elif sort.padded != (valid is not None) or (sort.documents > 1) != (docs is not None):
        raise ValueError(f"routes: the memory's sort was made {_with(sort.padded, sort.documents > 1)}, the inputs "
                         f"come {_with(valid is not None, docs is not None)}: route the memory with the inputs' "
                         f"key_padding_mask and documents (cross_routes, route_memory)")
    order, inverse, counts, _, _ = sort
    end = counts.cumsum(-1)  # (B, H, P · C [+ 1]): one past each (document, cluster)'s last sorted key
    first = end - counts
    if docs is None:  # one document a row: its real keys are the first ones of the sort
        seg_lo = first.new_zeros(())
        seg_hi = end[..., clusters - 1, None, None]  # (B, H, 1, 1)
        start = first.gather(-1, probes.reshape(B, H, Nq * p)).view(B, H, Nq, p)
    else:  # the query's document's real keys: [seg_lo, seg_hi) of the sort, (B, H, Nq, 1)
        qdoc = docs.queries[:, None, :, None] * clusters  # (B, 1, Nq, 1): its document's first label

        def at(table: Tensor, label: Tensor) -> Tensor:
            return table.gather(-1, label.expand(B, H, Nq, label.shape[-1]).reshape(B, H, -1)).view(B, H, Nq, -1)

        seg_lo, seg_hi, start = at(first, qdoc), at(end, qdoc + clusters - 1), at(first, qdoc + probes)
    real = seg_hi - seg_lo
    w = torch.clamp((real + clusters - 1) // clusters, min=1) if window is None else real.clamp(max=bound)
    lo = torch.maximum(torch.minimum(start, seg_hi - w), seg_lo)
    hi = torch.minimum(lo + w, seg_hi)  # (B, H, Nq, p): each probe's window of the sorted memory
    lo, at = lo.sort(-1)  # the windows by start: each begins where those before it ended (a key counts once)
    hi = hi.gather(-1, at)
    ended = F.pad(hi.cummax(-1).values[..., :-1], (1, 0))
    lo = torch.maximum(lo, ended)
    hi = torch.maximum(hi, lo)
    spans = Ranges(lo.reshape(B, H, Nq * p), hi.reshape(B, H, Nq * p), width=bound, merge=p,
                   documents=None if docs is None else docs.queries)
    return get_executor(executor, q.device).ranges(inputs, spans, order=KeyOrder(order, inverse))[0]


def routing_cross_mask(routes: CrossRoutes, window: int | None = None, key_padding_mask: Tensor | None = None,
                       documents: CrossDocuments | None = None) -> Tensor:
    """What ``routing_cross_attention`` means, written apart from it: (B, H, Nq, Nk) bool, True where query i reads
    memory key j. Only the real keys of the query's document count (``documents``: any ids, each side's d-th run
    the same document; None: one a row). Each such key's place in the (cluster, position) order among them counted
    from pairwise comparisons, each probe's window the places [min(first, real - window) clamped at 0, + window)
    with ``real`` the document's real keys. O(Nq · Nk²) memory."""
    keys, probes, clusters, _ = routes
    B, H, Nk = keys.shape
    Nq = probes.shape[2]
    real = torch.ones(B, Nk, dtype=torch.bool, device=keys.device) if key_padding_mask is None else key_padding_mask
    if documents is None:
        qdoc, kdoc = keys.new_zeros(B, Nq), keys.new_zeros(B, Nk)
    else:  # the d-th run of ids on each side: count the changes
        qdoc, kdoc = (F.pad((ids.diff(dim=-1) != 0).long().cumsum(-1), (1, 0)) for ids in documents)
    mine = (qdoc[:, :, None] == kdoc[:, None, :]) & real[:, None, :]  # (B, Nq, Nk): the query's document's real keys
    mine = mine[:, None]  # (B, 1, Nq, Nk)
    count = mine.sum(-1)  # (B, 1, Nq)
    w = torch.ceil(count / clusters).long().clamp(min=1) if window is None else torch.clamp(count, max=window)
    pos = torch.arange(Nk, device=keys.device)
    before = (keys[..., None, :] < keys[..., :, None]) | (
        (keys[..., None, :] == keys[..., :, None]) & (pos[None, :] < pos[:, None]))  # [j, j']: j' sorts before j
    place = (before[:, :, None] & mine[..., None, :]).sum(-1)  # (B, H, Nq, Nk): its document's keys before j
    allowed = torch.zeros(B, H, Nq, Nk, dtype=torch.bool, device=keys.device)
    for t in range(probes.shape[-1]):
        c = probes[..., t]  # (B, H, Nq)
        first = ((keys[:, :, None, :] < c[..., None]) & mine).sum(-1)  # its document's keys of lower clusters
        lo = torch.minimum(first, count - w).clamp(min=0)[..., None]
        allowed |= (place >= lo) & (place < lo + w[..., None]) & mine
    return allowed


class RoutedCrossHeads(nn.Module):
    """Routed cross-attention heads with their own online spherical k-means (a decoder layer's, over the memory an
    encoder made): q (B, h, Nq, D) over the memory ``Inputs.cross(q, k, v, key_padding_mask=...)`` ->
    (B, h, Nq, D), ``routing_cross_attention`` under ``cross_routes`` to the centroids.

    The centroids follow the memory's real keys alone (their unit vectors' statistics, observed in a training
    forward and applied by ``after_optimizer_step``, all-reduced across ranks: ``SphericalKMeans``); padded memory
    keys move nothing. In training the commitment term β · mean ||r - sg(μ_c)||² of the real keys and of the queries
    (each to its first probe: pulling the queries towards the keys' clusters, as separate self-routing does) is
    ``aux_loss()``. Nothing a query reads depends on another query. ``warmup``: for the first ``warmup`` optimiser
    steps the heads read every memory key (full cross-attention, in training, evaluation and decoding alike) while
    the k-means observes and the commitment pulls as after it: a query learns which key it wants before it must
    find its cluster (the lookup task, docs/model.md). Time O((Nq + Nk) · C · D + Nq · p · window · D) per head.
    """

    def __init__(self, heads: int, head_dim: int, num_clusters: int, *, probes: int = 1, window: int | None = None,
                 decay: float = 0.999, commitment: float = 1e-4, warmup: int = 0) -> None:
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
        self.warmup = non_negative_int("warmup", warmup)
        self._steps = 0  # a Python mirror of the buffer: a forward picks its mode without reading a tensor
        if self.warmup:  # optimiser steps taken, saved so that a resumed run goes on in the same phase
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.warmup:
            self._steps = int(self.steps)

    @property
    def warming_up(self) -> bool:
        """Whether the heads still read every memory key (their first ``warmup`` optimiser steps)."""
        return self._steps < self.warmup

    def routes(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None,
               documents: Tensor | None = None) -> CrossRoutes:
        """The memory keys' clusters and sort (with its (B, Nk) padding and numbered documents) and the queries'
        probes under the current centroids (no gradient)."""
        return cross_routes(q, k, self.kmeans.centroids, self.probes, self.executor, key_padding_mask, documents)

    def prepare(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> tuple[Tensor, MemorySort]:
        """The memory's routes for decoding: its keys' clusters and sort, made once (``decode``)."""
        return route_memory(k, self.kmeans.centroids, self.executor, key_padding_mask)

    def decode(self, inputs: Inputs, prepared: tuple[Tensor, MemorySort]) -> Tensor:
        """New queries (``Inputs.cross``, the memory's keys and values as ``prepare`` saw them) over the memory routed
        once: only the queries are routed. Equal to the forward's rows (to the ranges' rounding)."""
        refuse_cross_documents(inputs, "decoding over a remembered memory")
        if self.warming_up:
            return full_attention(inputs, None, self.executor, causal=False)
        keys, sort = prepared
        probes = route_queries(inputs.q, self.kmeans.centroids, self.probes, self.executor)
        return routing_cross_attention(inputs, CrossRoutes(keys, probes, self.kmeans.num_clusters, sort),
                                       self.window, self.executor)

    def forward(self, inputs: Inputs) -> Tensor:
        if not inputs.is_cross:
            raise ValueError("RoutedCrossHeads reads a memory: give Inputs.cross(q, k, v, key_padding_mask=...)")
        q, k = inputs.q, inputs.k
        valid = None if inputs.key_valid is None else inputs.key_valid[:, 0]  # (B, Nk): the real memory keys
        docs = inputs.cross_documents
        if self.warming_up and not self.training:  # nothing routes and nothing is observed
            self.commitment_loss = None
            return full_attention(inputs, None, self.executor, causal=False)
        routes = self.routes(q, k, valid, None if docs is None else docs.memory)
        if self.training:
            acc = torch.promote_types(q.dtype, torch.float32)
            rk, rq = (F.normalize(x.to(acc), dim=-1) for x in (k, q))  # with their gradient, for the commitment
            self.kmeans.observe(rk.detach(), routes.keys, valid)
            seen = None if valid is None else torch.cat([valid, valid.new_ones(q.shape[0], q.shape[2])], 1)
            self.commitment_loss = self.commitment * self.kmeans.commitment(
                torch.cat([rk, rq], 2), torch.cat([routes.keys, routes.probes[..., 0]], 2), seen)
        else:
            self.commitment_loss = None
        if self.warming_up:
            return full_attention(inputs, None, self.executor, causal=False)
        return routing_cross_attention(inputs, routes, self.window, self.executor)

    def aux_loss(self) -> Tensor | None:
        return self.commitment_loss

    def after_optimizer_step(self, step: int | None = None, group: dist.ProcessGroup | None = None) -> bool:
        """The k-means step (call after each ``optimizer.step()`` on every rank), and the warm-up's count."""
        self.kmeans.update(group)
        if self._steps < self.warmup:
            self.steps.add_(1)
            self._steps += 1
        return True

    def replicated_state(self) -> dict[str, Tensor]:
        """The buffers every rank must hold bit-identical: the centroids and their running statistics."""
        return {f"kmeans.{name}": buf for name, buf in self.kmeans.named_buffers() if not name.startswith("pending")}

    def extra_repr(self) -> str:
        warmup = f", warmup={self.warmup}" if self.warmup else ""
        return (f"heads={self.heads}, head_dim={self.head_dim}, num_clusters={self.kmeans.num_clusters}, "
                f"probes={self.probes}, window={self.window}{warmup}")


__all__ = ["CrossRoutes", "MemorySort", "RoutedCrossHeads", "cross_routes", "default_window", "route_memory",
           "route_queries", "routing_cross_attention", "routing_cross_mask", "sort_memory"]
