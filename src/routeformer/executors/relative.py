"""Relative position representations (Shaw, Uszkoreit and Vaswani, 2018).

    e_ij = q_i · (k_j + a^K_ij) / sqrt(D)        z_i = Σ_j α_ij (v_j + a^V_ij)
    a^K_ij = w^K[clip(j - i, k)],  a^V_ij = w^V[clip(j - i, k)],  clip(x, k) = max(-k, min(k, x))

2k + 1 learned vectors for each of K and V, shared across heads. Executors never build the (N, N, D) tensors of
the equations (see ``tiles/``). Where a tile's distances are shift-invariant they expand the tables to one row per
distance the tile holds (at most O(span) rows: a sliding window's strip, or the S + T - 1 diagonals of a tile) and
apply them with batched matmuls on strided views of the scores and probabilities; where distances are irregular
they multiply queries by all 2k + 1 rows once and gather per score. The extra memory is O(#scores), i.e.
O(N · window) for local attention.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..checks import positive_int


class RelativePositions(nn.Module):
    """Learned tables ``key`` and ``value`` of shape (2·max_distance + 1, head_dim); row ``d + k`` is distance d."""

    def __init__(self, head_dim: int, max_distance: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.head_dim = positive_int("head_dim", head_dim)
        self.max_distance = positive_int("max_distance", max_distance)
        self.key = nn.Parameter(torch.randn(2 * self.max_distance + 1, self.head_dim) * init_std)
        self.value = nn.Parameter(torch.randn(2 * self.max_distance + 1, self.head_dim) * init_std)

    def index(self, delta: Tensor) -> Tensor:
        """Table row of each relative distance ``delta = j - i`` (any integer tensor)."""
        return delta.clamp(-self.max_distance, self.max_distance) + self.max_distance

    def tables(self, delta: Tensor | int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Rows a^K, a^V of relative distances ``delta = j - i`` (clipped to ±max_distance) in ``dtype``: one int
        gives two (D,) vectors, an integer tensor two (*delta.shape, D) tensors."""
        if isinstance(delta, Tensor):
            idx: Tensor | int = self.index(delta)
        else:
            idx = max(-self.max_distance, min(self.max_distance, int(delta))) + self.max_distance
        return self.key.to(dtype)[idx], self.value.to(dtype)[idx]

    def check(self, q: Tensor) -> None:
        """Raise if the tables cannot be used with queries ``q`` of shape (B, H, N, D)."""
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"rel_pos has head_dim {self.head_dim} but q has D = {q.shape[-1]}")
        if self.key.device != q.device:
            raise ValueError(f"rel_pos tables are on {self.key.device} but q is on {q.device}")

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_distance={self.max_distance}"
