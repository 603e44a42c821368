"""The sequence viewed as a row-major grid of ``width`` columns, each column becoming its own sequence.

Position i sits in row i // width, column i % width. Attention "every width-th position" (the Sparse Transformer's
strided heads, Longformer's dilated window) is ordinary attention along a column: transpose, attend, transpose
back. Columns are folded into the batch dimension, so they are just more sequences to the executor.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_columns(x: Tensor, width: int) -> Tensor:
    """(B, H, N, *rest) -> (B · width, H, R, *rest), R = ceil(N / width); N padded with zeros to R · width."""
    B, H, N = x.shape[:3]
    rows = -(-N // width)
    if rows * width != N:
        x = torch.cat([x, x.new_zeros(B, H, rows * width - N, *x.shape[3:])], dim=2)
    x = x.view(B, H, rows, width, *x.shape[3:]).movedim(3, 1)  # (B, width, H, R, *rest)
    return x.reshape(B * width, H, rows, *x.shape[4:])


def from_columns(x: Tensor, width: int, n: int) -> Tensor:
    """Inverse of ``to_columns``: (B · width, H, R, *rest) -> (B, H, n, *rest)."""
    H, rows = x.shape[1:3]
    x = x.view(-1, width, H, rows, *x.shape[3:]).movedim(1, 3)  # (B, H, R, width, *rest)
    return x.reshape(x.shape[0], H, rows * width, *x.shape[4:])[:, :, :n]


def columns_key_valid(key_valid: Tensor | None, batch: int, n: int, width: int, device: torch.device) -> Tensor | None:
    """Key validity (B · width, 1, R) in column layout: the padding mask and the grid's own padding."""
    if key_valid is None:
        if n % width == 0:
            return None
        key_valid = torch.ones(batch, 1, n, dtype=torch.bool, device=device)
    return to_columns(key_valid, width)
