"""The relative-position terms of a tiling that the fused op's strip form does not cover (see ``TileRelTerms``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..relative import RelativePositions


class TileRelTerms:
    """The two relative-position terms of one tiling: q_i·a^K_ij on the scores and Σ_j p_ij a^V_ij on the output.

    Three ways, from fastest to most general:
    - strip (an ``offsets`` tiling with unit distances, handled by ``tiled_attention`` itself, not here): a sliding
      window's keys lie on a strip of the tile whose column t is at distance (t + offset - back·T) · unit for every
      row, so both terms are batched matmuls of q and p against the (W, D) tables on a strided view of the tile
      (inside the fused ``routeformer::tile_attention`` op), with no copy.
    - skew (``Distances.unit`` otherwise): distance depends only on s - r, so the L = S + T - 1 distances of a tile
      are enumerated once, queries multiply that extended table, and a strided view picks row r's entries
      (Transformer-XL's relative shift); the value term is the transposed operation.
    - gather (``Distances.delta``, or ``Distances.positions`` turned into deltas): queries multiply the whole table
      and each entry is gathered (scattered back for the value term). Used where distances are irregular (summary
      cells, global tokens, routing's sorted order).
    """

    def __init__(self, rel_pos: RelativePositions, qt: Tensor, block: int, span: int, back: int,
                 unit: int | None, delta: Tensor | None) -> None:
        """Skew with ``unit``, else gather with ``delta`` (exactly one is given)."""
        self.qt, self.block, self.span = qt, block, span
        self.index: Tensor | None = None
        dtype, device = qt.dtype, qt.device
        if unit is not None:  # extended column u: span column s = u - (T - 1) + r
            first = -(block - 1) - back * block
            delta = (torch.arange(span + block - 1, device=device) + first) * unit
            self.key_table, self.value_table = rel_pos.tables(delta, dtype)  # (L, D)
        else:
            self.key_table, self.value_table = rel_pos.key.to(dtype), rel_pos.value.to(dtype)  # (2k+1, D)
            self.index = rel_pos.index(delta.to(device))

    def _skew(self, x: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """size, stride, offset of the view V[..., r, s] = X[..., r, s + T - 1 - r] of X (..., T, L), contiguous and
        starting its storage (a fresh result, as both callers' are)."""
        T, S = self.block, self.span
        return (*x.shape[:-1], S), (*x.stride()[:-2], S + T - 2, 1), T - 1

    def add_scores(self, scores: Tensor) -> Tensor:
        """scores (B, H, nb, T, S) plus q_i·a^K_ij (skew or gather)."""
        qa = self.qt @ self.key_table.T  # (B, H, nb, T, L) or (B, H, nb, T, 2k+1): fresh, contiguous, offset 0
        if self.index is None:
            return scores + qa.as_strided(*self._skew(qa))
        return scores + qa.gather(-1, self.index.expand(*qa.shape[:-1], self.index.shape[-1]))

    def values(self, probs: Tensor) -> Tensor:
        """Σ_j p_ij a^V_ij for probs (B, H, nb, T, S) -> (B, H, nb, T, D) (skew or gather)."""
        if self.index is None:
            ext = probs.new_zeros(*probs.shape[:-1], self.span + self.block - 1)
            ext = torch.as_strided_scatter(ext, probs, *self._skew(ext))
        else:
            ext = probs.new_zeros(*probs.shape[:-1], self.value_table.shape[0])
            ext = ext.scatter_add(-1, self.index.expand_as(probs), probs)
        return ext @ self.value_table
