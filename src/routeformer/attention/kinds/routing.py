"""Routing heads (Roy et al. 2020): online spherical k-means routes each position to a cluster, and a query attends
to the last `routing_window` positions of its cluster (``routing/``).

Decoding keeps a ring buffer of `window` keys per cluster, O(k·D + window·D). The k-means step runs after each
optimiser step (``after_optimizer_step``); the commitment loss is the group's ``aux_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..executors import check_backend
from ..routing import RoutingAttention
from .base import HeadGroup, HeadKind
from .common import within_seq_len


@dataclass(frozen=True)
class RoutingOptions:
    num_clusters: int  # config.num_clusters: k
    window: int  # config.routing_window: keys per query
    shared_qk: bool  # config.shared_qk
    separate: bool  # config.separate_routing
    decay: float  # config.kmeans_decay
    commitment: float  # config.commitment


class RoutingHeads(HeadGroup):
    """Routing heads; with shared QK the model passes the queries as keys."""

    def __init__(self, heads: int, head_dim: int, options: RoutingOptions, seed: int) -> None:
        super().__init__(heads, head_dim)
        o = options
        self.num_clusters = o.num_clusters
        self.routing = RoutingAttention(heads, head_dim, o.num_clusters, o.window, causal=True,
                                        shared_qk=o.shared_qk, separate=o.separate, decay=o.decay,
                                        commitment=o.commitment, seed=seed)

    @property
    def backend(self) -> str:
        return self.routing.backend

    @backend.setter
    def backend(self, name: str) -> None:
        self.routing.backend = check_backend(name)

    def forward(self, q, k, v, rel_pos):
        return self.routing(q, k, v, rel_pos=rel_pos)

    def aux_loss(self):
        return self.routing.commitment_loss

    def after_optimizer_step(self, step, group):
        self.routing.update_routing(group)
        return True

    def reference_mask(self, q, k):
        return self.routing.routing_mask(q, k)

    def clusters(self, q, k):
        return self.routing.route(q, k)

    @torch.no_grad()
    def reach(self, q, k, rows, cols, sources):
        """Cluster balance (keys in the largest cluster / mean), and how often the key at ``sources`` is in the
        cluster of the query at (``rows``, ``cols``) and within its window (each a scalar over the heads)."""
        routing = self.routing
        clusters, key_clusters = routing.route(q, k), routing.route_keys(q, k)  # (B, H, N)
        sizes = F.one_hot(key_clusters, routing.num_clusters).sum(2).float()  # (B, H, k) keys per cluster
        return {"balance": (sizes.max(-1).values / sizes.mean(-1)).mean(),
                "in_cluster": (clusters[rows, :, cols] == key_clusters[rows, :, sources]).float().mean(),
                "in_window": routing.routing_mask(q, k)[rows, :, cols, sources].float().mean()}

    def new_cache(self, batch, max_len, device, dtype):
        return self.routing.new_cache(batch, None, device=device, dtype=dtype)  # the model checks max_len

    def decode(self, q, k, v, cache, start, rel_pos):
        return self.routing.decode(q, k, v, cache, rel_pos=rel_pos)


def _options(config: Any, heads: int) -> RoutingOptions:
    window = within_seq_len(config, "routing_window", "routing")
    if config.num_clusters > config.seq_len:
        raise ValueError(f"num_clusters ({config.num_clusters}) is larger than seq_len ({config.seq_len})")
    return RoutingOptions(config.num_clusters, window, config.shared_qk, config.separate_routing,
                          config.kmeans_decay, config.commitment)


def _keys_per_query(o: RoutingOptions, n: int) -> float:
    keys = min(o.window, n) + o.num_clusters  # + routing each token to k centroids
    return 2 * keys if o.separate else keys  # separate: 2N events (a key and a query per position), each banded


KIND = HeadKind(
    "routing",
    lambda o, heads, head_dim, seed: RoutingHeads(heads, head_dim, o, seed),
    keys_per_query=_keys_per_query,
    options=_options,
    shares_qk=lambda o: o.shared_qk,
    describe=lambda o: f"k={o.num_clusters}, w={o.window}" + (", separate" if o.separate else ""),
    summary="the last `routing_window` positions of the query's k-means cluster",
)
