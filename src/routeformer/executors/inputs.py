"""The validation prologue every public attention function runs before computing anything."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from ..checks import check_key_padding_mask, check_qkv, check_scale
from .relative import RelativePositions


class Inputs(NamedTuple):
    batch: int
    heads: int
    n: int
    head_dim: int
    scale: float
    key_valid: Tensor | None  # (B, 1, N) bool, broadcast over heads; None when every key is real


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None,
    key_padding_mask: Tensor | None,
    rel_pos: RelativePositions | None = None,
) -> Inputs:
    """Validate q, k, v (B, H, N, D), the scale, a (B, N) key padding mask and relative-position tables."""
    B, H, N, D = check_qkv(q, k, v)
    resolved = check_scale(scale, D)
    mask = check_key_padding_mask(key_padding_mask, B, N, q.device)
    if rel_pos is not None:
        if not isinstance(rel_pos, RelativePositions):
            raise ValueError(f"rel_pos must be a RelativePositions module or None, got {type(rel_pos).__name__}")
        rel_pos.check(q)
    return Inputs(B, H, N, D, resolved, None if mask is None else mask[:, None, :])
