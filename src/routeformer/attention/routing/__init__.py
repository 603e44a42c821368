"""Routing attention: online spherical k-means routes queries and keys; each attends within its cluster.

- ``router.py``: ``Router``, which assigns positions to groups (routing vectors W_R, k-means assignment, statistics,
  commitment loss, the update step), and ``update_routing``.
- ``layer.py``: ``RoutingAttention``, the routing heads: a ``Router`` and attention within its groups (forward,
  ``routing_mask``, decoding, the warm-up); a model's head group and a module of its own.
- ``options.py``: ``RoutingOptions`` (options.routing).
- ``kmeans.py``: ``SphericalKMeans``, centroids that move only in an explicit update step.
- ``sorted_window.py``: attention within groups as a window over the group-sorted sequence, causal or not (with its
  log-sum-exp, so several routing rounds merge exactly).
- ``probes.py``: several clusters per query (and separate routing): the last `window` keys of each, one softmax.
- ``balanced.py``: the paper's balanced clusters for encoders.
- ``cross.py``: routed cross-attention: queries of one sequence read a memory's keys sorted by cluster.
- ``cache.py``: per-cluster ring buffers for incremental decoding.
- ``kind.py``: the routing head kind's registry entry (options completed against the model, cost, warm-up).
"""

from .cache import RoutingCache
from .cross import CrossRoutes, RoutedCrossHeads, cross_routes, routing_cross_attention
from .kmeans import SphericalKMeans
from .layer import RoutingAttention
from .options import RoutingOptions
from .router import Router, update_routing

__all__ = ["CrossRoutes", "RoutedCrossHeads", "Router", "RoutingAttention", "RoutingCache", "RoutingOptions",
           "SphericalKMeans", "cross_routes", "routing_cross_attention", "update_routing"]
