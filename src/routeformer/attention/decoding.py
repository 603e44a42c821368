"""One decoding step: a new query against the keys a cache kept for it."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..executors.relative import RelativePositions


class Cached(NamedTuple):
    """What a cache kept for a query: keys, values (B, H, M, D) and their positions, (M,) or (B, H, M)."""

    keys: Tensor
    values: Tensor
    positions: Tensor


def seen(positions: Tensor, since: Tensor | None, allowed: Tensor | None = None) -> Tensor | None:
    """What a decoded query may see of cached keys at ``positions`` (M,) or (B, H, M): ``allowed`` (broadcast to
    (B, H, M), or None for all) and, with packed documents' ``since`` (B,), each row's document's first position,
    only the keys from there on: (B, 1 or H, M), or ``allowed`` as it is without ``since``."""
    if since is None:
        return allowed
    mine = positions >= since[:, None, None]  # (B, 1, M) or (B, H, M)
    return mine if allowed is None else allowed & mine


def attend_cached(
    q: Tensor,
    cached: Cached,
    t: int,
    *,
    scale: float,
    allowed: Tensor | None = None,
    rel_pos: RelativePositions | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """Attention of the query at position ``t`` to cached keys.

    q: (B, H, D); cached: the keys, values (B, H, M, D) and their positions (M,) or (B, H, M); allowed: optional
    bool mask broadcastable to (B, H, M); bias: optional additive score term broadcastable to (B, H, M). Returns
    (B, H, D); zeros when no key is allowed. O(M · D) per head.
    """
    keys, values, key_pos = cached
    qs = q.to(keys.dtype) * scale
    scores = torch.einsum("bhd,bhmd->bhm", qs, keys)
    if rel_pos is not None:
        table_k, table_v = rel_pos.tables(key_pos - t, keys.dtype)  # (M, D) or (B, H, M, D)
        scores = scores + (qs[..., None, :] @ table_k.transpose(-1, -2)).squeeze(-2)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    has_key = torch.isfinite(scores).any(-1, keepdim=True)
    probs = torch.where(has_key, scores, 0.0).softmax(-1) * has_key
    out = torch.einsum("bhm,bhmd->bhd", probs, values)
    if rel_pos is not None:
        out = out + (probs[..., None, :] @ table_v).squeeze(-2)
    return out.to(q.dtype)
