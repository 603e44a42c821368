"""The fused executor's feature scan (``Executor.scan_run``): causal attention through elu's or Performer's features
as one C++ operator forward and one recomputing backward (``csrc/scan.cpp``) where the kernels are built (float32
and float64 on the CPU), else ``None`` and the caller takes the PyTorch scan (``attention/feature_scan.py``, the
definition): the same sums, added in another order."""

from __future__ import annotations

import torch
from torch import Tensor

from ..tiling import FeatureKernel
from . import op


def scan_chunk(features: int) -> int:
    """The kernel's chunk where the caller gives none: F/4 as a power of two, clamped to [32, 64]. Per query the
    exact triangle costs c·(F + D) and the state 2·F·D whatever c, while small products run further from the
    matmul roofline. Measured (2 threads, H = 8, D = 64, fwd+bwd, medians of 3-4 alternated): elu (F = 64) at
    N = 8192 c = 32 67-71 ms, 64 76-79 ms (at 16384 within noise of each other); Performer (m = 266) c = 64 308 ms,
    128 352 ms (16384: 664, 800 ms)."""
    c = 1 << max(0, (max(1, features) // 4).bit_length() - 1)
    return min(64, max(32, c))


def fused_feature_scan(q: Tensor, k: Tensor, v: Tensor, kernel: FeatureKernel, chunk: int | None,
                       key_valid: Tensor | None, documents: Tensor | None = None) -> Tensor | None:
    """o_i = Σ_{j<=i} φ(q_i)·φ(k_j) v_j / Σ_{j<=i} φ(q_i)·φ(k_j) (a row without a key: 0) in chunks of ``chunk``
    rows (None: ``scan_chunk``), φ the features of ``kernel``: q, k, v (B, H, N, D) -> (B, H, N, D); key_valid
    (B, 1, N) bool or None; documents (B, N) ids that never decrease along a row, or None: each document a sequence
    of its own (its chunks from its first row, its sums those it has alone, bit for bit). O(N·(c + F)·D) time
    forward and backward, O(c·(c + F) + (N/c)·F·D) scratch per thread;
    autograd keeps q, k, v, the output and the (B, H, N) denominators. ``None`` where k or v is not q's dtype or
    device, or the projection asks for a gradient (the caller's autograd path gives it one); reached through
    ``Executor.runner(q)``, which decided that the kernels take q."""
    projection = kernel.projection
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device:
        return None
    if projection is not None and (projection.requires_grad or projection.device != q.device):
        return None
    features = q.shape[-1] if projection is None else projection.shape[1]
    chunk = scan_chunk(features) if chunk is None else chunk
    projection = None if projection is None else projection.to(q.dtype).contiguous()
    valid = None if key_valid is None else key_valid.to(q.device).contiguous()
    ids = None if documents is None else documents.to(q.device, torch.long).contiguous()
    return op.FeatureScanFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), valid, projection, ids, chunk,
                                        float(kernel.scale))
