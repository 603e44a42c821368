"""The router's unit routing vectors (``Executor.vectors_run``) as one fused CPU operator forward and one backward
(``csrc/vectors.cpp``) where the kernels are built (float32 and float64 on the CPU), else ``None`` and the caller
takes PyTorch's ``F.normalize`` and einsum (``attention.routing.router``, the definition): the same vectors, summed
in another order."""

from __future__ import annotations

from torch import Tensor

from . import op

EPS = 1e-12  # F.normalize's: a vector shorter than this is divided by it instead of its norm


def fused_routing_vectors(x: Tensor, projection: Tensor) -> Tensor | None:
    """r = x / max(||x||, eps) · W_R per head, with its gradient at x: x (B, H, N, D), projection W_R (H, D, D), a
    fixed buffer (no gradient). O(N · D²) time, O(N) kept for the backward besides x. ``None`` where the projection
    asks for a gradient (the caller's autograd path gives it one) or lies elsewhere; reached through
    ``Executor.runner(q)``, which decided that the kernels take the call."""
    if projection.requires_grad or projection.device != x.device:
        return None
    return op.RouteVectorsFunction.apply(x, projection.to(x.dtype).contiguous(), EPS)
