"""The pieces the patterns are built from, as values the executor's one operation takes:
``executor.tiled(inputs, piece, rel=..., need_lse=...)``.

A ``Tiling`` is the plain piece. The others say what they mean and lay the call out once, for every executor: the
tiling, and for ``Subset`` and ``Columns`` the gathered or grid inputs and the relative distances; ``Columns`` puts
the result back from the grid. Being values, they cost no call of their own between a mechanism and its kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .grid import columns_key_valid, from_columns, to_columns
from .inputs import Inputs, RelTerms
from .tiling import Distances, Tiling


class Laid(NamedTuple):
    """One piece's call as ``tiled`` computes it: the inputs (gathered, or the grid's), the tiling and the relative
    terms at the piece's distances."""

    inputs: Inputs
    tiling: Tiling
    rel: RelTerms | None


@dataclass(frozen=True, eq=False)
class Band:
    """Sliding window over the sequence order of q, k, v (or over q[order], k[order], v[order]: see
    ``Tiling.order``): causal i - window < j <= i, else |i - j| < window (``Tiling.band``). Time O(N · window · D),
    memory O(N · window)."""

    window: int
    causal: bool
    order: Tensor | None = None

    def lay(self, inputs: Inputs, rel: RelTerms | None) -> Laid:
        tiling = Tiling.band(self.window, inputs.q.shape[2], self.causal)
        if self.order is not None:
            tiling = dataclasses.replace(tiling, order=self.order)
        return Laid(inputs, tiling, rel)


@dataclass(frozen=True)
class BlockDiagonal:
    """Attention within blocks of ``block`` positions (j <= i too when causal); block >= N is one dense tile. Time
    O(N · block · D), memory O(N · block)."""

    block: int
    causal: bool

    def lay(self, inputs: Inputs, rel: RelTerms | None) -> Laid:
        size = min(self.block, inputs.q.shape[2])
        # causal as the offsets j - i <= 0 within a block, not a mask tensor: read by executors from the tiling,
        # with no host read of a device tensor (flex's relative value pass enumerates those offsets)
        return Laid(inputs, Tiling(block=size, offsets=(1 - size, 0)) if self.causal else Tiling(block=size), rel)


@dataclass(frozen=True, eq=False)
class Subset:
    """Every query against the keys at positions ``key_idx`` (M,) only, under ``allow`` (N, M) (rows may be empty):
    one dense (N, M) tile of the gathered keys (key validity gathered alike), relative distances key_idx[m] - i.
    Time O(N · M · D), memory O(N · M)."""

    key_idx: Tensor
    allow: Tensor | None

    def lay(self, inputs: Inputs, rel: RelTerms | None) -> Laid:
        q, key_valid, idx = inputs.q, inputs.key_valid, self.key_idx
        N = q.shape[2]
        if rel is not None:
            rel = rel.at(Distances(delta=idx[None, :] - torch.arange(N, device=q.device)[:, None]))
        gathered = inputs.with_(k=inputs.k[:, :, idx], v=inputs.v[:, :, idx],
                                key_valid=None if key_valid is None else key_valid[:, :, idx])
        return Laid(gathered, Tiling.dense(N, allow=self.allow), rel)


@dataclass(frozen=True)
class Columns:
    """Keys in the query's column of the (N / width, width) grid at least ``gap`` rows away (earlier when causal):
    the Sparse Transformer's strided heads, by the transpose trick (``grid.py``). Each column is one dense (R, R)
    tile, R = ceil(N / width); relative distances are width · (row difference). Time O(N · R · D), memory
    O(N · R)."""

    width: int
    causal: bool
    gap: int

    def lay(self, inputs: Inputs, rel: RelTerms | None) -> Laid:
        q, width = inputs.q, self.width
        B, _, N, _ = q.shape
        r = torch.arange(-(-N // width), device=q.device)
        offset = r[None, :] - r[:, None]  # key row - query row
        if self.causal:
            allow: Tensor | None = offset <= -self.gap
        else:
            allow = offset.abs() >= self.gap if self.gap else None
        grid = Inputs(to_columns(q, width), to_columns(inputs.k, width), to_columns(inputs.v, width),  # (B·w, H, R, D)
                      inputs.scale, columns_key_valid(inputs.key_valid, B, N, width, q.device))
        return Laid(grid, Tiling.dense(r.shape[0], allow=allow), None if rel is None else rel.at(Distances(unit=width)))

    def finish(self, inputs: Inputs, out: Tensor, lse: Tensor | None) -> tuple[Tensor, Tensor | None]:
        N = inputs.q.shape[2]
        return from_columns(out, self.width, N), None if lse is None else from_columns(lse, self.width, N)


Piece = Tiling | Band | BlockDiagonal | Subset | Columns


def lay(piece: Piece, inputs: Inputs, rel: RelTerms | None) -> Laid:
    """``piece``'s call: a tiling as it is, any other piece laid out by itself."""
    return Laid(inputs, piece, rel) if isinstance(piece, Tiling) else piece.lay(inputs, rel)


def finish(piece: Piece, inputs: Inputs, out: Tensor, lse: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The result of ``piece``'s call on ``inputs`` in their own layout (``Columns``: back from the grid)."""
    return piece.finish(inputs, out, lse) if isinstance(piece, Columns) else (out, lse)
