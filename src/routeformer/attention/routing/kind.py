"""Routing heads (Roy et al. 2020): online spherical k-means routes each key to a cluster, and a query attends to
the last `window` keys of each cluster it probes (``routing/``).

Decoding keeps a ring buffer of `window` keys per cluster, O(k·D + p·window·D) per token; during a dense warm-up it
keeps every position, as full attention does. The k-means and bias step runs after each optimiser step
(``after_optimizer_step``); the commitment loss is the group's ``aux_loss``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...checks import positive_int
from ...executors import Backend, Executor, executor_for
from ..kinds.base import HeadGroup, HeadKind, Warmup
from ..kinds.common import at_most_seq_len, boolean, non_negative_int
from ..reference import reference_attention
from .layer import RoutingAttention
from .probes import probe_masks


@dataclass(frozen=True)
class RoutingOptions:
    """options.routing.

    Fields:
        num_clusters: k; default round(sqrt(seq_len)).
        window: keys per probed cluster; default seq_len // (num_clusters · probes), so that a query scores about
            seq_len / k keys.
        shared_qk: the heads use their queries as keys (the official text configurations).
        separate: route queries by q and keys by k (needs shared_qk = false); see ``RoutingAttention``.
        decay, commitment: the k-means EMA decay and the commitment loss's weight β.
        probes: the clusters each query probes (p; it scores up to p · window keys). The paper's rule: 1, with
            balance 0.
        balance: the step of the bias that balances the clusters between optimiser steps (0: plain argmax).
        warmup: optimiser steps of dense causal attention before the heads route (0: none; a warm-up is part of a
            training recipe, as a learning-rate warm-up is; routing learns long-range retrieval only after one,
            see the README's recall benchmark).
        warmup_len: the sequence length the warm-up trains at (None: seq_len; it must divide seq_len): the
            trainers cut each batch into sequences that long while the warm-up lasts.
        handover: optimiser steps after the warm-up in which the heads still attend to every earlier key, the keys
            routing would not score pushed down by a penalty growing to 16 nats (``RoutingAttention``), at the
            model's length; then they route. Dense cost, like the warm-up.
        gate: weigh each probed cluster by the query's softmax over its centroid scores.
    """

    num_clusters: int | None = None
    window: int | None = None
    shared_qk: bool = True
    separate: bool = False
    decay: float = 0.999
    commitment: float = 1e-4
    probes: int = 2
    balance: float = 0.01
    warmup: int = 0
    warmup_len: int | None = None
    handover: int = 0
    gate: bool = False

    def __post_init__(self) -> None:
        for name in ("num_clusters", "window", "warmup_len"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        positive_int("probes", self.probes)
        for name in ("shared_qk", "separate", "gate"):
            boolean(name, getattr(self, name))
        if self.separate and self.shared_qk:
            raise ValueError("separate = true routes queries and keys apart, which needs shared_qk = false")
        if isinstance(self.decay, bool) or not (isinstance(self.decay, numbers.Real) and 0.0 <= self.decay < 1.0):
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")
        if isinstance(self.commitment, bool) or not (isinstance(self.commitment, numbers.Real)
                                                     and self.commitment >= 0):
            raise ValueError(f"commitment must be non-negative, got {self.commitment!r}")
        if isinstance(self.balance, bool) or not (isinstance(self.balance, numbers.Real)
                                                  and 0.0 <= self.balance < math.inf):
            raise ValueError(f"balance must be a non-negative number (0: no bias), got {self.balance!r}")
        non_negative_int("warmup", self.warmup)
        non_negative_int("handover", self.handover)


def default_routing_window(seq_len: int, num_clusters: int, probes: int) -> int:
    """Keys per probed cluster so that a routing query scores about seq_len / k keys over its probes."""
    return max(1, seq_len // (num_clusters * probes))


class RoutingHeads(HeadGroup):
    """Routing heads; with shared QK the model passes the queries as keys."""

    def __init__(self, heads: int, head_dim: int, options: RoutingOptions, seed: int) -> None:
        super().__init__(heads, head_dim)
        o = options
        self.num_clusters = o.num_clusters
        self.routing = RoutingAttention(heads, head_dim, o.num_clusters, o.window, causal=True,
                                        shared_qk=o.shared_qk, separate=o.separate, probes=o.probes,
                                        balance=o.balance, warmup=o.warmup, handover=o.handover, gate=o.gate,
                                        decay=o.decay,
                                        commitment=o.commitment, seed=seed)

    @property
    def backend(self) -> Executor:
        return self.routing.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self.routing.backend = executor_for(backend)

    def forward(self, q, k, v, rel_pos):
        return self.routing(q, k, v, rel_pos=rel_pos)

    def aux_loss(self):
        return self.routing.commitment_loss

    def after_optimizer_step(self, step, group):
        self.routing.update_routing(group)
        return True

    def reference_mask(self, q, k):
        return self.routing.routing_mask(q, k)

    def reference_bias(self, q, k):  # the hand-over: every earlier key, the unrouted ones lowered by the penalty
        routing = self.routing
        return routing.handover_bias(routing.routes(q, k), q.dtype) if routing.handing_over else None

    def reference(self, q, k, v, rel_pos=None):
        routing = self.routing
        if routing.gate and not routing.dense:  # the probes' softmaxes weighed by the gates
            routes = routing.routes(q, k)
            masks = probe_masks(routes.keys, routes.probes, routing.window)  # (B, h, p, N, N)
            if routing.shared_qk:  # the own key only where the union holds nothing else
                eye = torch.eye(q.shape[2], dtype=torch.bool, device=q.device)
                masks = masks & ~(eye & (masks.any(2) & ~eye).any(-1, keepdim=True))[:, :, None]
            gates = routing._gates(routes)
            return sum(gates[:, :, :, t, None] * reference_attention(q, k, v, masks[:, :, t], scale=self.scale,
                                                                     rel_pos=rel_pos)
                       for t in range(routing.probes))
        return super().reference(q, k, v, rel_pos)

    def clusters(self, q, k):
        return self.routing.route(q, k)

    @torch.no_grad()
    def reach(self, q, k, rows, cols, sources):
        """Cluster balance (keys in the largest cluster / mean), and for each probe t how often the key at
        ``sources`` is in cluster t of the query at (``rows``, ``cols``) and within its window there (scalars over
        the heads; ``in_cluster`` and ``in_window`` over all probes)."""
        routing = self.routing
        routes = routing.routes(q, k)
        sizes = F.one_hot(routes.keys, routing.num_clusters).sum(2).float()  # (B, H, k) keys per cluster
        home = routes.keys[rows, :, sources]  # (S, H): the cluster of each needed key
        hit = routes.probes[rows, :, cols] == home[..., None]  # (S, H, p)
        windows = probe_masks(routes.keys, routes.probes, routing.window)[rows, :, :, cols, sources]  # (S, H, p)
        out = {"balance": (sizes.max(-1).values / sizes.mean(-1)).mean(),
               "in_cluster": hit.any(-1).float().mean(), "in_window": windows.any(-1).float().mean()}
        for t in range(routing.probes):
            out[f"in_cluster_{t + 1}"] = hit[..., t].float().mean()
            out[f"in_window_{t + 1}"] = windows[..., t].float().mean()
        return out

    # Decoding: the routed ring buffers, or during the warm-up and hand-over every position (``HeadGroup``'s store).
    def new_cache(self, batch, max_len, device, dtype):
        if self.routing.handing_over and not self.routing.shared_qk:
            raise ValueError("decoding during the routing hand-over needs shared_qk = true (a key's cluster then "
                             "comes from the cached key alone); decode before or after the hand-over")
        if self.routing.dense:
            return super().new_cache(batch, max_len, device, dtype)
        return self.routing.new_cache(batch, None, device=device, dtype=dtype)  # the model checks max_len

    def step(self, q, cache, t, rel_pos):  # every earlier key; shared QK: its own only at t = 0
        keys, values, positions = cache.filled()
        allowed = (positions < t) | (positions == 0) if self.routing.shared_qk else None
        bias = self._handover_row(q, keys) if self.routing.handing_over else None
        return self.attend(q, keys, values, positions, t, rel_pos, allowed=allowed, bias=bias)

    def _handover_row(self, q, keys):
        """(B, h, M): the hand-over's penalty of the query at t on the cached keys (positions 0 … t, in order): row
        t of ``RoutingAttention.handover_bias``."""
        routing = self.routing
        clusters = routing.routes(keys, keys).keys  # (B, h, M): shared QK, a key routes as the query it was
        probes = routing.routes(q[:, :, None], q[:, :, None]).probes[:, :, 0]  # (B, h, p)
        member = F.one_hot(clusters, routing.num_clusters)
        newer = member.flip(2).cumsum(2).flip(2).gather(-1, clusters[..., None])[..., 0] - 1  # same cluster, in (j, t]
        routed = (clusters[..., None] == probes[:, :, None, :]).any(-1) & (newer < routing.window)
        return (~routed).to(q.dtype) * -routing.handover_penalty()

    def decode(self, q, k, v, cache, start, rel_pos):
        if self.routing.dense:
            return super().decode(q, k, v, cache, start, rel_pos)
        return self.routing.decode(q, k, v, cache, rel_pos=rel_pos)


def _complete(o: RoutingOptions, config: Any) -> RoutingOptions:
    k = max(1, round(math.sqrt(config.seq_len))) if o.num_clusters is None else o.num_clusters
    if k > config.seq_len:
        raise ValueError(f"num_clusters ({k}) is larger than seq_len ({config.seq_len})")
    if o.probes > k:
        raise ValueError(f"probes ({o.probes}) must be at most num_clusters ({k})")
    window = default_routing_window(config.seq_len, k, o.probes) if o.window is None else o.window
    at_most_seq_len("window", window, config)
    length = o.warmup_len
    if length is not None:
        if length > config.seq_len or config.seq_len % length:
            raise ValueError(f"warmup_len ({length}) must divide seq_len ({config.seq_len}): the warm-up trains on "
                             f"each sequence cut into pieces that long")
        # Without a warm-up it has nothing to set (as a learning-rate warm-up's settings with none): a configuration
        # that ships a warm-up stays usable with `--set options.routing.warmup=0`, and the heads describe none.
        length = length if o.warmup else None
    return dataclasses.replace(o, num_clusters=k, window=window, warmup_len=length)


def _keys_per_query(o: RoutingOptions, n: int) -> float:
    return o.probes * min(o.window, n) + o.num_clusters  # + routing each token to k centroids


def _warmup(o: RoutingOptions) -> tuple[Warmup, ...]:
    # every earlier key, and still the routing (the k-means and the bias learn all along); the hand-over at the
    # model's length
    dense = lambda n: (n + 1) / 2 + o.num_clusters  # noqa: E731
    warmup = Warmup(o.warmup, dense, o.warmup_len)
    return (warmup, Warmup(o.warmup + o.handover, dense)) if o.handover else (warmup,)


def _describe(o: RoutingOptions) -> str:
    text = f"k={o.num_clusters}, w={o.window}"
    for name, value, default in (("p", o.probes, 1), ("bias", o.balance, 0.0), ("warm-up", o.warmup, 0)):
        if value != default:
            text += f", {name}={value:g}"
    if o.warmup_len is not None:
        text += f" at length {o.warmup_len}"
    if o.handover:
        text += f", hand-over={o.handover}"
    return text + (", separate" if o.separate else "") + (", gate" if o.gate else "")


KIND = HeadKind(
    "routing",
    lambda o, heads, head_dim, seed: RoutingHeads(heads, head_dim, o, seed),
    keys_per_query=_keys_per_query,
    warmup=_warmup,
    option_type=RoutingOptions,
    complete=_complete,
    shares_qk=lambda o: o.shared_qk,
    describe=_describe,
    summary="the last `window` keys of each of the `probes` k-means clusters the query probes",
)
