"""Rows of a (B, H, N, D) tensor moved along N on CUDA: ``kernels.move`` behind one custom operator,
``routeformer_flex::move_rows``, the flex executor's ``kernel`` for ``executors.rows.move_rows`` (the sort of a
sequence by cluster and back).

One pass that reads each row where it lies (any strides: the heads of a projection need no copy first) and writes
it where the index sends it, scaled on the way. PyTorch's ``index_select`` over the flattened rows took ~316 µs per
(8 · 65,536, 64) bfloat16 tensor on an H200 (0.4 TB/s), six of them per routing step at N = 65,536 (docs/gpu.md).
Time and memory O(M · D).
"""

from __future__ import annotations

import torch
from torch import Tensor

ROWS = 64  # rows per program


def launch(x: Tensor, index: Tensor, scale: float) -> Tensor:
    """The operator's body (on CUDA; on CPU tensors under ``TRITON_INTERPRET=1``, for the tests): x (B, H, N, D)
    of any strides, index (B, H, M) int64 (entries past N - 1 read row N - 1) -> (B, H, M, D) contiguous,
    out[..., j, :] = x[..., index[j], :] · scale."""
    from . import kernels

    B, H, N, D = x.shape
    M = index.shape[-1]
    out = torch.empty(B, H, M, D, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    kernels.move[(-(-M // ROWS), B * H)](x, index.contiguous(), out, H, N, M, D, *x.stride(), SCALE=scale,
                                         BLOCK_M=ROWS, BLOCK_D=kernels.next_pow2(D))
    return out


@torch.library.custom_op("routeformer_flex::move_rows", mutates_args=(), device_types="cuda")
def _move_rows(x: Tensor, index: Tensor, scale: float) -> Tensor:
    return launch(x, index, scale)


@_move_rows.register_fake
def _(x, index, scale):
    return x.new_empty(*index.shape, x.shape[-1])


def moved(x: Tensor, index: Tensor, scale: float) -> Tensor | None:
    """``executors.rows.move_rows``'s ``kernel``: x[..., min(index, N - 1), :] · scale on CUDA (and ``meta``,
    shapes only) as the custom operator; None elsewhere (the caller's index_select: the CPU, where flex is for
    tests)."""
    if x.device.type not in ("cuda", "meta"):
        return None
    return torch.ops.routeformer_flex.move_rows(x, index, scale)


__all__ = ["launch", "moved"]
