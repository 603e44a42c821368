"""Full (dense) attention: the O(N²) baseline every sparse pattern is measured against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .inputs import check_inputs
from .relative import RelativePositions
from .tiles import tiled_attention


def full_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    key_padding_mask: Tensor | None = None,
    rel_pos: RelativePositions | None = None,
) -> Tensor:
    """Dense softmax attention over every key (j <= i when causal).

    q, k, v: (B, H, N, D) -> (B, H, N, D). Runs through ``scaled_dot_product_attention`` (fused kernels where the
    backend has them). With ``rel_pos`` the scores are explicit: one (N, N) tile per head, O(N²) memory.
    O(N²·D) time.
    """
    B, H, N, D, scale, key_valid = check_inputs(q, k, v, scale, key_padding_mask, rel_pos)
    if rel_pos is not None:
        allow = torch.ones(N, N, dtype=torch.bool, device=q.device).tril() if causal else None
        out, _ = tiled_attention(q, k, v, block=N, allow=allow, scale=scale, key_valid=key_valid,
                                 rel_pos=rel_pos, rel_unit=1)
        return out
    if key_valid is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    allow = key_valid[:, :, None, :]  # (B, 1, 1, N)
    if causal:
        allow = allow & torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    has_key = allow.any(-1, keepdim=True)  # (B, 1, N, 1)
    # SDPA may return NaN for a row with no key on some backends: give such rows key 0, then zero them.
    first = torch.arange(N, device=q.device) == 0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allow | (~has_key & first), scale=scale)
    return out.masked_fill(~has_key, 0.0)
