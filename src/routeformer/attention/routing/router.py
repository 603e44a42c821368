"""The router: assigns every key to a cluster and gives every query the clusters it probes.

    q, k ──► r = normalise(q) · W_R            (shared QK: one vector per position)
             r = normalise(n(q) + n(k)) · W_R   (joint: one vector per position)
             r_q = n(q) · W_R, r_k = n(k) · W_R  (separate: a query vector and a key vector per position)
         ──► s = <μ_c, r> + b_c                  (B, H, N, k) cosines to the centroids, plus the balancing bias
         ──► key cluster  c(j) = argmax_c s(r_k(j))
             probes       P(i) = its p best clusters by s(r_q(i)), best first (c(i) first, unless separate)
         ──► k-means statistics and cluster loads (training forward only)

Balance without a leak: the bias b (H, k) is model state that changes only between optimiser steps, b_c += rate ·
sign(mean load - load_c), the loads counting the keys each cluster received in the training forwards since the last
step (the auxiliary-loss-free balancing of mixture-of-experts routers). No token competes with another token of its
sequence, so which cluster a key joins depends on that key alone, never on later positions; balance comes from the
bias over training. ``balance=0`` keeps the plain argmax of the paper.

A router knows nothing of attention: ``RoutingAttention`` (``layer.py``) routes with it and attends within the
clusters. Another way of grouping positions (hash buckets) can reuse that attention as it is.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ...checks import positive_int
from ...executors.base import Executor
from ...executors.inputs import check_inputs
from ...executors.routes import Routed
from .balanced import balanced_members
from .kmeans import SphericalKMeans
from .options import RoutingOptions, read_option
from .sorted_window import ClusterOrder

MEMBER_CHUNK = 1 << 24  # balanced clusters' scores (elements) made at once: 64 MiB in float32


class Routes(NamedTuple):
    """The routing of one forward pass.

    scores: (B, H, N, k) cosines of the queries' routing vectors to the centroids plus the bias where there is one,
        float32 or wider (balanced clusters over packed documents read them; they carry no gradient: routing learns
        outside it).
    keys: (B, H, N) long, the cluster of every key.
    probes: (B, H, N, p) long, the distinct clusters every query probes, best first. Unless routing is separate,
        ``probes[..., 0]`` is the position's own cluster ``keys``.
    vectors: (B, H, N, D) the queries' unit routing vectors, with their gradient (for the gates).
    sort: the keys sorted by (cluster, position) (``ClusterOrder`` without ranks) where the fused router made it,
        else None (the attention sorts).

    ``scores`` is None where an executor's router chose without them (``routes(..., need_scores=False)``).
    """

    scores: Tensor | None
    keys: Tensor
    probes: Tensor
    vectors: Tensor
    sort: ClusterOrder | None = None


class Router(nn.Module):
    """Online spherical k-means routing of (B, H, N, D) queries and keys into ``num_clusters`` clusters per head.

    Args:
        heads, head_dim: H and D.
        options: ``RoutingOptions`` (num_clusters given); the router reads
            num_clusters: k centroids per head;
            shared_qk: queries and keys are the same vectors: a position routes on its query alone. Otherwise it
                routes on normalise(n(q_i) + n(k_i)) (one vector per position), unless ``separate``;
            separate: route queries by q and keys by k (needs shared_qk=False): a key joins the cluster of its key
                vector, a query probes the clusters nearest its query vector, so W_Q and W_K can learn to meet in a
                cluster as they meet in q·k; the centroids follow the keys alone (a centroid no key joins still stays,
                and a query may probe it: issue 70's trained runs);
            probes: p, the clusters each query probes (1: its own cluster only);
            balance: the bias step per optimiser step (0: no bias, the paper's plain argmax);
            decay, commitment: k-means EMA decay λ and the commitment-loss weight β.
        seed: seed of the fixed random orthonormal routing projection W_R.
        counted: keep ``steps``, the number of ``update`` calls (a buffer saved with the model), for a warm-up.

    State: ``projection`` W_R (H, D, D), a buffer; ``kmeans`` the centroids (``SphericalKMeans``); with ``balance``
    the bias ``bias`` (H, k), a buffer saved with the model. Centroids and bias move only in ``update``
    (``update_routing`` calls it for every router in a model once per optimiser step), from statistics all-reduced
    across ranks, so they stay identical on every rank. After ``routes(..., observe=True)`` in training mode,
    ``commitment_loss`` holds β · mean ||r - sg(μ_c)||² (None after a forward in evaluation mode). Cost
    O(N · D² + N · k · D) time, O(N · k) memory per head.
    """

    def __init__(self, heads: int, head_dim: int, options: RoutingOptions, *, seed: int = 0,
                 counted: bool = False) -> None:
        super().__init__()
        if not isinstance(options, RoutingOptions) or options.num_clusters is None:
            raise ValueError(f"options must be RoutingOptions with num_clusters given, got {options!r}")
        self.heads = positive_int("heads", heads)
        self.head_dim = positive_int("head_dim", head_dim)
        self.options = options  # checked by RoutingOptions (probes <= num_clusters included)
        self.kmeans = SphericalKMeans(heads, head_dim, self.num_clusters, decay=options.decay)
        gen = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(self.heads, self.head_dim, self.head_dim, generator=gen))
        self.register_buffer("projection", q)  # W_R (H, D, D), fixed random orthonormal
        # Only with a balance: a model without one keeps the paper rule's state dict (a None buffer is not saved).
        self.register_buffer("bias", torch.zeros(self.heads, self.num_clusters) if self.balance else None)
        self.register_buffer("pending_load", torch.zeros(self.heads, self.num_clusters) if self.balance else None,
                             persistent=False)
        self.commitment_loss: Tensor | None = None
        self._steps = 0  # a python mirror of `steps`: a forward decides its mode without reading a tensor
        if counted:  # a warm-up reads how many updates there were; the count is saved with the model
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    num_clusters = read_option("num_clusters")
    probes = read_option("probes")
    shared_qk = read_option("shared_qk")
    separate = read_option("separate")
    balance = read_option("balance")
    commitment = read_option("commitment")

    @property
    def updates(self) -> int:
        """How many ``update`` steps this router has taken (counted only when built with ``counted=True``)."""
        return self._steps

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if getattr(self, "steps", None) is not None:
            self._steps = int(self.steps)

    # --- routing -------------------------------------------------------------------------------------------
    def routing_vectors(self, q: Tensor, k: Tensor) -> Tensor:
        """Unit routing vectors (B, H, N, D) in float32 or wider, whatever the input dtype or autocast state; separate
        routing: the keys' and the queries' as events (B, H, 2N, D), each position's key event first."""
        rq, rk = self.query_and_key_vectors(q, k)
        if rq is rk:
            return rq
        B, H, N, D = rq.shape
        return torch.stack([rk, rq], dim=3).reshape(B, H, 2 * N, D)

    def query_and_key_vectors(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Unit routing vectors of the queries and of the keys, (B, H, N, D) each, in float32 or wider whatever the
        input dtype or autocast state; one tensor twice unless routing is separate. PyTorch's operators, the
        definition (``routes`` takes an executor's kernel for them where it has one)."""
        xs, proj = self.unturned(q, k)
        with _autocast_off(q.device):
            rq = turn(xs[0], proj)
            return rq, (rq if len(xs) == 1 else turn(xs[1], proj))

    def unturned(self, q: Tensor, k: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
        """What W_R turns into routing vectors once normalised: (q,) with shared QK, (q, k) separate, in their own
        dtype (``turn`` computes in W_R's), (n(q) + n(k),) joint; and W_R (H, D, D) in float32 or wider."""
        acc = torch.promote_types(q.dtype, torch.float32)
        proj = self.projection.to(acc)
        if self.separate:
            return (q, k), proj
        if self.shared_qk:
            return (q,), proj
        return (F.normalize(q.to(acc), dim=-1) + F.normalize(k.to(acc), dim=-1),), proj

    @torch.no_grad()
    def members(self, r: Tensor, window: int, key_padding_mask: Tensor | None = None) -> Tensor:
        """Balanced clusters' members (B, H, k, w) for the routing vectors r (B, H, N, D) (``Routes.vectors``):
        ``balanced.balanced_members`` of the biased scores, computed for a few clusters at a time, at most
        ``MEMBER_CHUNK`` scores at once, so that no (B, H, N, k) scores are made (a count of chunks fixed by the
        shapes: no host read). The same scores as ``routes``' (``SphericalKMeans.scores`` plus the bias)."""
        B, H, N, _ = r.shape
        step = max(1, MEMBER_CHUNK // max(1, B * H * N))
        parts = []
        for c0 in range(0, self.num_clusters, step):
            part = slice(c0, c0 + step)
            parts.append(balanced_members(self._biased(self.kmeans.scores(r, part), part), window, key_padding_mask))
        return torch.cat(parts, 2) if len(parts) > 1 else parts[0]

    def _biased(self, scores: Tensor, clusters: slice = slice(None)) -> Tensor:
        """The scores (of the centroids ``clusters``) plus their bias, in place (the scores are this forward's own
        tensor)."""
        return scores if self.bias is None else scores.add_(self.bias[:, None, clusters].to(scores.dtype))

    def _best(self, scores: Tensor) -> Tensor:
        """The ``probes`` largest scores' clusters (B, H, N, p), best first: argmax, then argmax again with the
        winner masked (in place, and put back): two passes cost less than ``topk`` on CPU (25 ms each against 65 at
        N = 16384, k = 128, 8 heads). Ties go to the lower index, as in argmax."""
        first = scores.argmax(-1, keepdim=True)
        if self.probes == 1:
            return first
        # Compiled: out of place (inductor cannot functionalise scatter_ into the einsum's permuted output, "Cannot
        # view a tensor with shape ..."; it fuses the passes anyway). Eager: in place, the winners put back after.
        compiling = torch.compiler.is_compiling()
        found, kept, masked = [first], [], scores
        for _ in range(self.probes - 1):
            if compiling:
                masked = masked.scatter(-1, found[-1], float("-inf"))
            else:
                kept.append(masked.gather(-1, found[-1]))
                masked.scatter_(-1, found[-1], float("-inf"))
            found.append(masked.argmax(-1, keepdim=True))
        for index, value in zip(found[:len(kept)], kept, strict=True):  # none when compiled
            scores.scatter_(-1, index, value)
        return torch.cat(found, -1)


    def routes(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None, *,
               observe: bool = False, need_scores: bool = True, executor: Executor | None = None) -> Routes:
        """Route q, k (B, H, N, D): the clusters of the keys and the probes of the queries (``Routes``).

        ``observe`` (a training forward): in training mode add the k-means statistics of the real positions
        (``key_padding_mask`` (B, N), True = real) and the keys' cluster loads for the next ``update``, and set
        ``commitment_loss``; in evaluation mode it observes nothing and sets ``commitment_loss`` to None.
        ``need_scores=False``: the scores may be left out, and where the ``executor``'s router takes the vectors
        (``Executor.route_run``, the fused CPU kernel or the flex executor's Triton kernels on CUDA) it chooses the
        clusters, sorts the keys and reduces the statistics without the (B, H, N, k) scores (separate routing: a
        second call gives the queries' probes from their own vectors); else PyTorch's operators here, the
        definition. The vectors likewise: the executor's normalise-and-turn (``Executor.vectors_run``, the fused
        CPU kernel) where it has one, else ``turn``."""
        runner = None if executor is None else executor.runner(q)
        xs, proj = self.unturned(q, k)
        turned = []
        with _autocast_off(q.device):
            for x in xs:  # the executor's kernel for normalise-and-turn (``Executor.vectors_run``) where it has one
                r = None if runner is None or runner.vectors_run is None else runner.vectors_run(x.to(proj.dtype), proj)
                turned.append(turn(x, proj) if r is None else r)
        rq, rk = turned[0], turned[-1]
        route_run = None if runner is None else runner.route_run
        if not need_scores and route_run is not None:
            counting = observe and self.kmeans.counting()
            # the keys' clusters, their sort and statistics; separate routing: then the queries' probes, a second
            # call on their own vectors that observes nothing
            got = route_run(rk, self.kmeans.centroids, self.bias, key_padding_mask, 1 if rq is not rk else self.probes,
                            counting)
            got_q = got if rq is rk or got is None else route_run(rq, self.kmeans.centroids, self.bias,
                                                                  key_padding_mask, self.probes, False)
            if got_q is not None:
                return self._kernel_routes((rq, rk), (got_q, got), key_padding_mask, observe=observe,
                                           counting=counting)
        scores = self._biased(self.kmeans.scores(rq))  # (B, H, N, k)
        probes = self._best(scores)  # a query's first probe is its best cluster
        if rq is rk:
            keys = probes[..., 0]
        else:
            keys = self._biased(self.kmeans.scores(rk)).argmax(-1)
        if observe:
            self._observe(rq, rk, probes[..., 0], keys, key_padding_mask)
        return Routes(scores, keys, probes, rq)

    def _kernel_routes(self, vectors: tuple[Tensor, Tensor], got: tuple[Routed, Routed],
                       key_padding_mask: Tensor | None, *, observe: bool, counting: bool) -> Routes:
        """``routes`` from an executor's router's results ``got`` = (the queries', the keys') for the routing vectors
        (rq, rk) (one tensor and one result twice unless routing is separate): the statistics the keys' call reduced
        added (``counting``), the commitment loss set from the cosines (``observe``; separate routing: the keys' and
        the queries', as ``_observe``)."""
        (rq, rk), (got_q, got_k) = vectors, got
        keys = got_k.probes[..., 0]
        if observe:
            if counting:
                self.kmeans.add_reduced(rk.detach(), got_k.sums, got_k.weights, key_padding_mask)
                if self.bias is not None:
                    self.pending_load += got_k.weights.to(self.pending_load.dtype)  # the keys' loads: their counts
            r, clusters, valid, cosine = rk, keys, key_padding_mask, got_k.cosine
            if rq is not rk:
                r, clusters = torch.cat([rk, rq], dim=2), torch.cat([keys, got_q.probes[..., 0]], dim=2)
                valid = None if key_padding_mask is None else key_padding_mask.repeat(1, 2)
                cosine = torch.cat([got_k.cosine, got_q.cosine], dim=2)
            self.commitment_loss = (self.commitment * self.kmeans.commitment(r, clusters, valid, cosine)
                                    if self.training else None)
        sort = ClusterOrder(got_k.order, got_k.inverse, got_k.grouped, None, got_k.counts)
        return Routes(None, keys, got_q.probes, rq, sort)

    def _observe(self, rq: Tensor, rk: Tensor, query_clusters: Tensor, keys: Tensor,
                 key_padding_mask: Tensor | None) -> None:
        # The centroids follow the keys alone. Separate routing once let them follow the queries too: where W_Q and
        # W_K point apart, clusters split into query-only and key-only ones, and a query probing a query-only
        # cluster sees no key. This is not all of it: trained with this rule (issue 70), 10 of 12 separate heads
        # still attend nothing, their queries probing centroids that no key of theirs joins.
        self.kmeans.observe(rk.detach(), keys, key_padding_mask)
        if rq is rk:
            r, clusters, valid = rk, keys, key_padding_mask
        else:  # separate: both commit to their centroids, which pulls the queries towards the keys' clusters
            r, clusters = torch.cat([rk, rq], dim=2), torch.cat([keys, query_clusters], dim=2)
            valid = None if key_padding_mask is None else key_padding_mask.repeat(1, 2)
        self.commitment_loss = (self.commitment * self.kmeans.commitment(r, clusters, valid)
                                if self.training else None)
        if self.bias is not None and self.kmeans.counting():
            H, k = self.heads, self.num_clusters
            flat = torch.arange(H, device=keys.device)[None, :, None] * k + keys  # (B, H, N): head h's cluster c
            weight = (torch.ones_like(flat, dtype=self.pending_load.dtype) if key_padding_mask is None
                      else key_padding_mask[:, None, :].to(self.pending_load.dtype).expand(flat.shape))
            self.pending_load.view(-1).index_add_(0, flat.reshape(-1), weight.reshape(-1))

    @torch.no_grad()
    def route(self, q: Tensor, k: Tensor) -> Tensor:
        """The cluster every query probes first: (B, H, N) long (its own cluster, unless routing is separate)."""
        check_inputs(q, k, v=q, scale=None, key_padding_mask=None)
        return self.routes(q, k).probes[..., 0]

    @torch.no_grad()
    def route_keys(self, q: Tensor, k: Tensor) -> Tensor:
        """The cluster of every key: (B, H, N) long."""
        check_inputs(q, k, v=q, scale=None, key_padding_mask=None)
        return self.routes(q, k).keys

    @torch.no_grad()
    def probe(self, q: Tensor, k: Tensor) -> Tensor:
        """The clusters every query probes, best first: (B, H, N, p) long."""
        check_inputs(q, k, v=q, scale=None, key_padding_mask=None)
        return self.routes(q, k).probes

    # --- the step between optimiser steps -------------------------------------------------------------------
    @torch.no_grad()
    def update(self, group: dist.ProcessGroup | None = None) -> None:
        """The k-means step and the bias step: apply the statistics observed since the last call (all-reduced
        across ranks). No host read of a device tensor (on CUDA none waits for the device): the step count moves
        on the device and in its Python mirror side by side."""
        self.kmeans.update(group)
        if getattr(self, "steps", None) is not None:
            self.steps.add_(1)
            self._steps += 1
        if self.bias is None:
            return
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.pending_load, group=group)
        load = self.pending_load
        # Loads are counts (>= 0): with none observed every sign is 0 and the bias stays, so no test of the sum.
        self.bias += self.balance * torch.sign(load.mean(-1, keepdim=True) - load)
        load.zero_()

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, num_clusters={self.num_clusters}, "
                f"shared_qk={self.shared_qk}, separate={self.separate}, probes={self.probes}, "
                f"balance={self.balance}")


NORM_EPS = 1e-12  # F.normalize's: a vector shorter than this is divided by it


def turn(x: Tensor, projection: Tensor) -> Tensor:
    """The routing vectors of x (B, H, N, D): normalise(x) · W_R per head, W_R = projection (H, D, D), computed in
    W_R's dtype (float32 or wider) as ``F.normalize`` and an einsum compute it; the gradient reaches x in its own
    dtype (W_R is a fixed buffer; one that requires a gradient takes autograd's own path)."""
    if projection.requires_grad:
        return torch.einsum("bhnd,hde->bhne", F.normalize(x.to(projection.dtype), dim=-1, eps=NORM_EPS), projection)
    return _Turn.apply(x, projection)


class _Turn(torch.autograd.Function):
    """normalise(x) · W_R with a backward of one matmul and a few (B, H, N, D) passes (autograd's backward of
    F.normalize takes about a dozen: on a GPU each a pass over N · D float32 per head, ~0.1 ms at N = 65,536). It
    keeps x as it came (a bfloat16 model's q: half the bytes of the float32 unit vectors, 64 MiB a layer at 65,536
    positions and 8 heads) and recomputes the unit vectors in the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, projection: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, projection)
        y, _, _ = _unit(x.to(projection.dtype))
        return torch.einsum("bhnd,hde->bhne", y, projection)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, projection = ctx.saved_tensors
        y, norm, clamped = _unit(x.to(projection.dtype))
        gy = torch.einsum("bhne,hde->bhnd", grad, projection)  # (B, H, N, D)
        # d(x / |x|) = (g - y (y · g)) / |x|; a clamped length divides x by a constant: g / eps
        radial = (y * gy).sum(-1, keepdim=True).masked_fill_(clamped, 0.0)
        return ((gy - y * radial) / norm).to(x.dtype), None


def _unit(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x / max(|x|, eps) as ``F.normalize`` computes it, with the divisor (..., 1) and where it was clamped."""
    length = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (B, H, N, 1)
    norm = length.clamp_min(NORM_EPS)
    return x / norm, norm, length < NORM_EPS


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device`` (the routing vectors are float32 or wider whatever the model computes in); the
    ``meta`` device, which shapes and counts a forward without computing it, has no autocast to turn off."""
    return contextlib.nullcontext() if device.type == "meta" else torch.autocast(device.type, enabled=False)


def update_routing(module: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Apply the k-means (and bias) step of every router inside ``module``, and of any k-means module outside a
    router; returns how many were updated.

    Call it once per optimiser step, after ``optimizer.step()``, on every rank.
    """
    routers = [m for m in module.modules() if isinstance(m, Router)]
    owned = {id(r.kmeans) for r in routers}
    loose = [m for m in module.modules() if isinstance(m, SphericalKMeans) and id(m) not in owned]
    for layer in [*routers, *loose]:
        layer.update(group)
    return len(routers) + len(loose)

