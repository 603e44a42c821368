"""Routing attention: online spherical k-means routes queries and keys; each attends within its cluster.

- ``layer.py``: ``RoutingAttention`` (routing vectors, forward, ``routing_mask``, decoding) and ``update_routing``.
- ``kmeans.py``: ``SphericalKMeans``, centroids that move only in an explicit update step.
- ``sorted_window.py``: causal (and non-causal) routing as a window over the cluster-sorted sequence.
- ``balanced.py``: the paper's balanced clusters for encoders.
- ``cache.py``: per-cluster ring buffers for incremental decoding.
"""

from .cache import RoutingCache
from .kmeans import SphericalKMeans
from .layer import RoutingAttention, update_routing

__all__ = ["RoutingAttention", "RoutingCache", "SphericalKMeans", "update_routing"]
