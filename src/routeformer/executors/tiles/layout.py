"""The key layout of the tiled executor: how (B, H, N, D) keys become rows whose spans a tile reads as a view.

Query block b of ``block`` = T rows sees key blocks b - back … b + ahead, a span of S = (back + 1 + ahead) · T keys.
``key_source`` lays every head's keys out as one run of rows (padded to whole blocks, with back·T rows before and
ahead·T after), so that span s of global block g is row g·T + s: one stride for all tiles, and ``key_windows`` gives
the (X, S, D) spans as an overlapping view (no copy; ``fold_windows`` is its gradient); ``tiling.Tiling.key_spans`` does
the same for per-key values (validity, groups, positions) to build the (…, nb, T, S) masks. Copies are O(N · D) at
most.
"""

from __future__ import annotations

import torch
from torch import Tensor


def key_source(x: Tensor, n_blocks: int, block: int, back: int, ahead: int) -> Tensor:
    """Rows (back·T + X·T + ahead·T, D) of x (B, H, N, D): each head padded to nb·T, all heads flattened, then
    back·T rows before and ahead·T after. Span s of global block g is then row g·T + s: one stride for all tiles,
    so ``key_windows`` is a view bmm reads directly. Spans that reach into a neighbouring head read finite values that
    the in-range mask removes."""
    B, H, N, D = x.shape
    if n_blocks * block == N and not (back or ahead):
        return x.contiguous().view(B * H * N, D)  # row r at r · D; no copy when x is contiguous
    return _KeyRows.apply(x, n_blocks, block, back, ahead)


class _KeyRows(torch.autograd.Function):
    """``key_source`` with padding: x written once into a zeroed buffer; the gradient is a view of the rows'."""

    @staticmethod
    def forward(x: Tensor, n_blocks: int, block: int, back: int, ahead: int) -> Tensor:
        B, H, N, D = x.shape
        rows = x.new_empty((back + B * H * n_blocks + ahead) * block, D)  # zeros only where x does not go
        rows[:back * block].zero_()
        rows[(back + B * H * n_blocks) * block:].zero_()
        body = rows[back * block:(back + B * H * n_blocks) * block].view(B, H, n_blocks * block, D)
        body[:, :, :N] = x
        body[:, :, N:].zero_()
        return rows

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, n_blocks, block, back, ahead = inputs
        ctx.shape, ctx.n_blocks, ctx.block, ctx.back = x.shape, n_blocks, block, back

    @staticmethod
    def backward(ctx, grad: Tensor):
        B, H, N, D = ctx.shape
        T, nb = ctx.block, ctx.n_blocks
        body = grad[ctx.back * T:(ctx.back + B * H * nb) * T].reshape(B, H, nb * T, D)
        return body[:, :, :N], None, None, None, None


def key_windows(x: Tensor, windows: tuple[int, int, int]) -> Tensor:
    """Spans (X, S, D) of key rows x from ``key_source``, S = (reach + 1) · block, as an overlapping view.

    ``windows = (X, block, reach)``: X tiles, whose spans start ``block`` rows apart (a single tile over Nk keys
    has block = Nk and reach = 0)."""
    tiles, block, reach = windows
    D = x.shape[-1]
    return x.as_strided((tiles, (reach + 1) * block, D), (block * D, D, 1))  # keeps x's own storage offset


def fold_windows(grad: Tensor, windows: tuple[int, int, int]) -> Tensor:
    """Gradient of ``key_windows``: the overlapping spans (X, S, D) summed back into key rows."""
    tiles, block, reach = windows
    D = grad.shape[-1]
    if reach == 0:  # spans that do not overlap (single tiles): the gradient is the spans' own, no copy
        return grad.reshape(tiles * block, D)
    out = grad.new_empty(tiles + reach, block, D)
    out[:tiles] = grad[:, :block]  # the first block of every span starts its rows: no zero pass first
    out[tiles:].zero_()
    for o in range(1, reach + 1):
        out[o:o + tiles] += grad[:, o * block:(o + 1) * block]
    return out.view((tiles + reach) * block, D)


def pad_seq(x: Tensor, extra: int) -> Tensor:
    """Pad dim 2 (the sequence) of x with ``extra`` zeros (False for bool) after it."""
    if extra == 0:
        return x
    pad = x.new_zeros(*x.shape[:2], extra, *x.shape[3:])
    return torch.cat([x, pad], dim=2)
