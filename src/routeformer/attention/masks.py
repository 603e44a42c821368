"""Helpers of the masks that say what each pattern means (each in its mechanism's module: ``full_mask`` in
``full.py``, ``local_mask`` in ``local.py``, …): the boolean mask (True = query i may attend to key j) written from
its definition as deliberately naive O(N²) comparisons of index grids, sharing no code with the fast executors, so
that the tests hold each executor to ``reference_attention(q, k, v, <pattern>_mask(...))``. Figures and analysis
use them too. Each returns (N, N), or (H, N, N) when the pattern differs between heads (or ``heads`` is given).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..checks import check_split_heads, positive_int


def index_grid(n: int, device: torch.device | str | None) -> tuple[Tensor, Tensor]:
    n = positive_int("n", n)
    idx = torch.arange(n, device=device)
    return idx[:, None], idx[None, :]  # i (query) down, j (key) across


def per_head_mask(mask: Tensor, heads: int | None) -> Tensor:
    if heads is None:
        return mask
    return mask.expand(positive_int("heads", heads), *mask.shape[-2:]).clone()


def split_mask(first: Tensor, second: Tensor, merged: bool, heads: int | None) -> Tensor:
    first, second = torch.broadcast_tensors(first, second)
    if merged:
        return per_head_mask(first | second, heads)
    if heads is None:
        raise ValueError("merged=False gives different heads different patterns: pass heads=")
    half = check_split_heads(positive_int("heads", heads))
    return torch.stack([first] * half + [second] * half)


