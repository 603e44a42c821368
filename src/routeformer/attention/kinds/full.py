"""Full heads: every earlier key, the O(N²·D) baseline."""

from __future__ import annotations

from typing import Any

from ..full import full_attention
from ..masks import full_mask
from .base import HeadGroup, HeadKind


class FullHeads(HeadGroup):
    """Decoding keeps every position; a step reads the filled part, O(t·D)."""

    def forward(self, q, k, v, rel_pos):
        return full_attention(q, k, v, causal=True, rel_pos=rel_pos)

    def reference_mask(self, q, k):
        return full_mask(q.shape[2], device=q.device)


def _build(options: Any, heads: int, head_dim: int, seed: int) -> FullHeads:
    return FullHeads(heads, head_dim)


KIND = HeadKind("full", _build, keys_per_query=lambda options, n: (n + 1) / 2, summary="every earlier key")
