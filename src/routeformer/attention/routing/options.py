"""options.routing: the typed options of routing heads, checked without the model (``kind.py`` completes them
against it)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ...checks import positive_int
from ..kinds.common import boolean, non_negative_int


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
        if self.num_clusters is not None and self.probes > self.num_clusters:
            raise ValueError(f"probes ({self.probes}) must be at most num_clusters ({self.num_clusters})")
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


def read_option(name: str) -> property:
    """A read-only attribute that reads ``self.options.<name>``: a routing setting is kept once, in the
    ``RoutingOptions`` a layer or router was given, and read from there."""
    return property(lambda self: getattr(self.options, name), doc=f"``options.{name}``")


def default_routing_window(seq_len: int, num_clusters: int, probes: int) -> int:
    """Keys per probed cluster so that a routing query scores about seq_len / k keys over its probes."""
    return max(1, seq_len // (num_clusters * probes))
