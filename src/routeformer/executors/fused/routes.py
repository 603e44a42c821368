"""The fused executor's router (``Executor.route_run``): the causal router's discrete part as one fused CPU kernel
where the kernels are built (float32 and float64 on the CPU), else ``None`` and the caller takes PyTorch's operators
(``attention.routing.router``): the same clusters (the scores summed in another order: a near-tie may fall the other
way), the same sort, the same statistics, and each position's cosine to its own centroid
(``executors.routes.Routed``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..routes import Routed
from . import op


def fused_route(r: Tensor, centroids: Tensor, bias: Tensor | None, key_padding_mask: Tensor | None, probes: int,
                observe: bool) -> Routed:
    """Route the unit routing vectors r (B, H, N, D) to the centroids (H, k, D) plus the bias (H, k): each position's
    ``probes`` best clusters, the counting sort by (cluster, position), and with ``observe`` the statistics of the
    positions ``key_padding_mask`` (B, N; True = real) keeps. O(N · k · D) time, O(N · p) memory per head, no
    (N, k) tensor; the statistics are added in a fixed order (the same for every thread count). Reached through
    ``Executor.runner(q)``, which decided that the kernels take the call."""
    valid = None if key_padding_mask is None else key_padding_mask[:, None, :].to(torch.bool).contiguous()
    with torch.no_grad():
        return Routed(*op.ops().route(r.detach(), centroids.to(r.dtype).contiguous(),
                                      None if bias is None else bias.to(r.dtype).contiguous(), valid, probes, observe))
