"""The router: assigns every position to a group, observes statistics, and moves on the optimiser step.

    q, k ──► r = normalise(q) · W_R          (shared QK)
             r = normalise(n(q) + n(k)) · W_R (separate QK)
             r_q = n(q) · W_R, r_k = n(k) · W_R (separate routing: 2N events, key event first)
         ──► c = argmax_j <μ_j, r>   (B, H, N) groups       ──► k-means statistics (training forward only)

A router knows nothing of attention: ``RoutingAttention`` (``layer.py``) routes with it and attends within the
groups with ``sorted_window_attention`` (or the balanced clusters). Another way of grouping positions (hash
buckets) can reuse that attention as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..checks import positive_int
from ..inputs import check_inputs
from .kmeans import SphericalKMeans
from .separate import interleave


class Router(nn.Module):
    """Online spherical k-means routing of (B, H, N, D) queries and keys into ``num_clusters`` groups per head.

    Args:
        heads, head_dim: H and D.
        num_clusters: k centroids per head.
        shared_qk: queries and keys are the same vectors: a position routes on its query alone. Otherwise it routes
            on normalise(n(q_i) + n(k_i)), one group per position.
        separate: route queries by q and keys by k (needs shared_qk=False): every position becomes two events, its
            key event 2p and its query event 2p + 1, each with its own group (``split`` takes them apart).
        decay, commitment: k-means EMA decay λ and the commitment-loss weight β.
        seed: seed of the fixed random orthonormal routing projection W_R.

    State: ``projection`` W_R (H, D, D), a buffer; ``kmeans`` the centroids (``SphericalKMeans``). Centroids move only
    in ``update`` (``update_routing`` calls it for every router in a model once per optimiser step). After
    ``assign_and_observe`` in training mode, ``commitment_loss`` holds β · mean ||r - sg(μ_c)||² (None after one in
    evaluation mode). Cost O(N · D² + N · k · D) time, O(N · k) memory per head.
    """

    def __init__(self, heads: int, head_dim: int, num_clusters: int, *, shared_qk: bool = True,
                 separate: bool = False, decay: float = 0.999, commitment: float = 1e-4, seed: int = 0) -> None:
        super().__init__()
        self.heads = positive_int("heads", heads)
        self.head_dim = positive_int("head_dim", head_dim)
        self.num_clusters = positive_int("num_clusters", num_clusters)
        self.shared_qk, self.separate = bool(shared_qk), bool(separate)
        if self.separate and self.shared_qk:
            raise ValueError("separate=True routes queries and keys apart: it needs shared_qk=False")
        self.commitment = float(commitment)
        self.kmeans = SphericalKMeans(heads, head_dim, num_clusters, decay=decay)
        gen = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(self.heads, self.head_dim, self.head_dim, generator=gen))
        self.register_buffer("projection", q)  # W_R (H, D, D), fixed random orthonormal
        self.commitment_loss: Tensor | None = None

    def routing_vectors(self, q: Tensor, k: Tensor) -> Tensor:
        """Unit routing vectors r (B, H, N, D) in float32 or wider, whatever the input dtype or autocast state;
        separate routing: the queries' and the keys' as events (B, H, 2N, D), key event first (``interleave``)."""
        acc = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            x = F.normalize(q.to(acc), dim=-1)
            if self.separate:
                x = interleave(F.normalize(k.to(acc), dim=-1), x)
            elif not self.shared_qk:
                x = F.normalize(x + F.normalize(k.to(acc), dim=-1), dim=-1)
            return torch.einsum("bhnd,hde->bhne", x, self.projection.to(acc))

    @torch.no_grad()
    def assign(self, q: Tensor, k: Tensor) -> Tensor:
        """The group of every routing vector: (B, H, N) long, or (B, H, 2N) events when separate (see ``split``).
        Observes nothing."""
        return self.kmeans.assign(self.routing_vectors(q, k))

    def split(self, clusters: Tensor) -> tuple[Tensor, Tensor]:
        """Groups of the routing vectors -> (query groups, key groups), each (B, H, N): the same tensor twice unless
        routing is separate."""
        return (clusters[:, :, 1::2], clusters[:, :, 0::2]) if self.separate else (clusters, clusters)

    @torch.no_grad()
    def route(self, q: Tensor, k: Tensor) -> Tensor:
        """The group of every query: (B, H, N) long."""
        check_inputs(q, k, v=q, scale=None, key_padding_mask=None)
        return self.split(self.assign(q, k))[0]

    @torch.no_grad()
    def route_keys(self, q: Tensor, k: Tensor) -> Tensor:
        """The group of every key: (B, H, N) long (the query's, unless routing is separate)."""
        check_inputs(q, k, v=q, scale=None, key_padding_mask=None)
        return self.split(self.assign(q, k))[1]

    def assign_and_observe(self, q: Tensor, k: Tensor,
                           key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Route a forward pass: (scores (B, H, N', k) cosines to the centroids, groups (B, H, N') argmax), N' = N
        (2N events when separate). In training mode also adds the k-means statistics of the real positions
        (``key_padding_mask`` (B, N), True = real) for the next ``update`` and sets ``commitment_loss``; in
        evaluation mode observes nothing and sets ``commitment_loss`` to None."""
        r = self.routing_vectors(q, k)
        scores = self.kmeans.scores(r)  # once: the groups and the balanced members both use it
        clusters = scores.argmax(-1)
        padding = self._event_padding(key_padding_mask)
        self.kmeans.observe(r.detach(), clusters, padding)
        self.commitment_loss = (self.commitment * self.kmeans.commitment(r, clusters, padding)
                                if self.training else None)
        return scores, clusters

    def _event_padding(self, key_padding_mask: Tensor | None) -> Tensor | None:
        """The padding mask of the routing vectors: (B, 2N) for separate routing's events."""
        if key_padding_mask is None or not self.separate:
            return key_padding_mask
        return key_padding_mask.repeat_interleave(2, dim=-1)

    def update(self, group: dist.ProcessGroup | None = None) -> None:
        """The k-means step: apply the statistics observed since the last call (all-reduced across ranks)."""
        self.kmeans.update(group)

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, num_clusters={self.num_clusters}, "
                f"shared_qk={self.shared_qk}, separate={self.separate}")


def update_routing(module: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Apply the k-means step of every routing layer inside ``module``; returns how many were updated.

    Call it once per optimiser step, after ``optimizer.step()``, on every rank.
    """
    layers = [m for m in module.modules() if isinstance(m, SphericalKMeans)]
    for layer in layers:
        layer.update(group)
    return len(layers)
