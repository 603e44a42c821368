"""The conventions every executor's log-sum-exp follows, and the exact merge that relies on them.

An executor's lse is in float32 or wider (``lse_dtype``), and a row that sees no key has lse =
``neg_inf(lse.dtype)`` exactly (``saw_key``), so ``merge_partials`` combines attention over disjoint key sets
exactly whichever executor computed each part.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def neg_inf(dtype: torch.dtype) -> float:
    """The score given to masked entries: finite, so an all-masked row stays NaN-free, yet exp(it - max) == 0.

    Also the lse ``tiled_attention`` returns, exactly, for a row that sees no key: ``neg_inf(lse.dtype)``, with lse
    in float32 or wider, so it lies below ``neg_inf(d) / 2`` for the dtype d of any input, and ``merge_partials``
    gives such a part weight 0 (or, merging only empty parts, keeps the merged lse there).
    """
    return torch.finfo(dtype).min


def saw_key(lse: Tensor) -> Tensor:
    """Rows of an lse from ``tiled_attention`` (or merged from them) that saw at least one key."""
    return lse > neg_inf(lse.dtype) / 2


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """lse is kept in float32 or wider: merging half-precision lse values would cost more than the softmax."""
    return torch.promote_types(dtype, torch.float32)


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge attention over disjoint key sets: [(out_i, lse_i)] each (B, H, N, D), (B, H, N) -> (out, lse).

    softmax over the union = Σ_i exp(lse_i - lse) · softmax_i, with lse = logsumexp_i(lse_i). Exact; computed in
    the lse dtype (float32 or wider) and returned in the dtype of the outputs. O(P · N · D) for P parts. A key
    in several parts counts once per part (softmax over the multiset union: its score is raised by log(count)).
    """
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), 0)  # (B, H, N)
    out = sum(o.to(lse.dtype) * (part_lse - lse).exp()[..., None] for o, part_lse in parts)
    return out.to(parts[0][0].dtype), lse
