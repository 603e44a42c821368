"""What an executor's router returns (``Executor.route_run``): the causal router's discrete part computed by a
backend's kernels, without the (B, H, N, k) scores: the fused CPU kernel (``fused/routes.py``) and the flex
executor's Triton kernels on CUDA (``flex/router.py``). Executors without one (tiles) leave routing to PyTorch's
operators (``attention.routing.router``), the definition the kernels are tested against."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Routed(NamedTuple):
    """probes (B, H, N, p) long, best first (``probes[..., 0]`` the key's own cluster); order, inverse, grouped
    (B, H, N) long: the sort by (cluster, position) and each sorted entry's cluster; counts (B, H, k) long, the
    cluster sizes; sums (H, k, D) and weights (H, k): the k-means statistics of the real positions (empty unless
    observed); cosine (B, H, N) in r's dtype: each position's cosine to its own cluster's centroid, without the
    bias (the commitment term's, ``SphericalKMeans.commitment``)."""

    probes: Tensor
    order: Tensor
    inverse: Tensor
    grouped: Tensor
    counts: Tensor
    sums: Tensor
    weights: Tensor
    cosine: Tensor


def routed_like(r: Tensor, centroids: Tensor, probes: int, observe: bool) -> tuple[Tensor, ...]:
    """Empty tensors of a router operator's outputs (``Routed``'s fields in order) for routing vectors r (B, H, N, D)
    and centroids (H, k, D): the fake implementation both routers' operators register (shapes only)."""
    B, H, N, D = r.shape
    k = centroids.shape[1]
    long = {"dtype": torch.long}
    return (r.new_empty(B, H, N, probes, **long), r.new_empty(B, H, N, **long), r.new_empty(B, H, N, **long),
            r.new_empty(B, H, N, **long), r.new_empty(B, H, k, **long),
            r.new_empty((H, k, D) if observe else (0,)), r.new_empty((H, k) if observe else (0,)), r.new_empty(B, H, N))
