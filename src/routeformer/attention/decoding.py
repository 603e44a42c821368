"""One decoding step: a new query against the keys a cache kept for it."""

from __future__ import annotations

import torch
from torch import Tensor

from .relative import RelativePositions


def attend_cached(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    key_pos: Tensor,
    t: int,
    *,
    scale: float,
    allowed: Tensor | None = None,
    rel_pos: RelativePositions | None = None,
) -> Tensor:
    """Attention of the query at position ``t`` to cached keys.

    q: (B, H, D); keys, values: (B, H, M, D); key_pos: positions of the keys, (M,) or (B, H, M); allowed: optional
    bool mask broadcastable to (B, H, M). Returns (B, H, D); zeros when no key is allowed. O(M · D) per head.
    """
    qs = q.to(keys.dtype) * scale
    scores = torch.einsum("bhd,bhmd->bhm", qs, keys)
    if rel_pos is not None:
        idx = rel_pos.index(key_pos - t)
        table_k, table_v = rel_pos.key.to(keys.dtype)[idx], rel_pos.value.to(keys.dtype)[idx]
        scores = scores + (torch.einsum("bhd,md->bhm", qs, table_k) if idx.dim() == 1
                           else torch.einsum("bhd,bhmd->bhm", qs, table_k))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    has_key = torch.isfinite(scores).any(-1, keepdim=True)
    probs = torch.where(has_key, scores, 0.0).softmax(-1) * has_key
    out = torch.einsum("bhm,bhmd->bhd", probs, values)
    if rel_pos is not None:
        out = out + (torch.einsum("bhm,md->bhd", probs, table_v) if idx.dim() == 1
                     else torch.einsum("bhm,bhmd->bhd", probs, table_v))
    return out.to(q.dtype)
