"""Local heads: the last `window` positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..local import local_attention
from ..masks import local_mask
from .base import HeadGroup, HeadKind
from .common import within_seq_len


@dataclass(frozen=True)
class LocalOptions:
    window: int  # config.window: keys per query


class LocalHeads(HeadGroup):
    """Decoding keeps a ring buffer of exactly the window, O(window·D)."""

    def __init__(self, heads: int, head_dim: int, window: int) -> None:
        super().__init__(heads, head_dim)
        self.window = window

    def forward(self, q, k, v, rel_pos):
        return local_attention(q, k, v, self.window, causal=True, rel_pos=rel_pos)

    def reference_mask(self, q, k):
        return local_mask(q.shape[2], self.window, device=q.device)

    def store_size(self, max_len):
        return min(self.window, max_len), True  # the ring holds exactly the window


def _options(config: Any, heads: int) -> LocalOptions:
    return LocalOptions(within_seq_len(config, "window", "local"))


KIND = HeadKind("local", lambda o, heads, head_dim, seed: LocalHeads(heads, head_dim, o.window),
                keys_per_query=lambda o, n: min(o.window, n), options=_options,
                summary="the last `window` positions")
