"""The fused executor's feature scan (``Executor.scan_run``): causal attention through elu's or Performer's features
as one C++ operator forward and one recomputing backward (``csrc/scan.cpp``) where the kernels are built (float32
and float64 on the CPU), else ``None`` and the caller takes the PyTorch scan (``attention/feature_scan.py``, the
definition): the same sums, added in another order."""

from __future__ import annotations

from torch import Tensor

from ..tiling import FeatureKernel
from . import op
from .executor import takes


def fused_feature_scan(q: Tensor, k: Tensor, v: Tensor, kernel: FeatureKernel, chunk: int,
                       key_valid: Tensor | None) -> Tensor | None:
    """o_i = Σ_{j<=i} φ(q_i)·φ(k_j) v_j / Σ_{j<=i} φ(q_i)·φ(k_j) (a row without a key: 0) in chunks of ``chunk``
    rows, φ the features of ``kernel``: q, k, v (B, H, N, D) -> (B, H, N, D); key_valid (B, 1, N) bool or None.
    O(N·(c + F)·D) time forward and backward, O(c·(c + F) + (N/c)·F·D) scratch per thread; autograd keeps q, k, v,
    the output and the (B, H, N) denominators. ``None`` where the kernels do not take q (or the projection asks
    for a gradient: the caller's autograd path gives it one)."""
    projection = kernel.projection
    if not takes(q) or k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device:
        return None
    if projection is not None and (projection.requires_grad or projection.device != q.device):
        return None
    projection = None if projection is None else projection.to(q.dtype).contiguous()
    valid = None if key_valid is None else key_valid.to(q.device).contiguous()
    return op.FeatureScan.apply(q.contiguous(), k.contiguous(), v.contiguous(), valid, projection, chunk,
                                float(kernel.scale))
