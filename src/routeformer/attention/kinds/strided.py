"""Strided heads (Sparse Transformer): the last l + 1 positions (A1) and every l-th position back (A2), l = stride.

Three kinds: 'strided' (A1 ∪ A2 in every head), 'strided_a1' and 'strided_a2' (one set each: the split heads
'strided_a1:4,strided_a2:4', or with one spec per layer the interleaved layers ['strided_a1', 'strided_a2']).

Decoding keeps every key (slot p holds position p; A2 reaches back to the start) and a step slices the query's
column t, t - l, t - 2l, … and the last l + 1 positions, O((l + t/l)·D) (a1: a ring of l + 1, O(l·D); a2: O(t/l·D)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..executors import get_executor
from ..local import local_attention
from ..masks import strided_mask
from ..strided import column_attention, strided_attention
from .base import HeadGroup, HeadKind
from .common import within_seq_len


@dataclass(frozen=True)
class StridedOptions:
    stride: int  # config.stride: l
    part: str  # 'merged', 'a1' or 'a2'


class StridedHeads(HeadGroup):
    """part: 'merged' (A1 ∪ A2), 'a1' (the last l + 1 positions) or 'a2' (every l-th position back)."""

    def __init__(self, heads: int, head_dim: int, stride: int, part: str) -> None:
        super().__init__(heads, head_dim)
        self.stride, self.part = stride, part

    def forward(self, q, k, v, rel_pos):
        if self.part == "merged":
            return strided_attention(q, k, v, self.stride, causal=True, rel_pos=rel_pos, backend=self.backend)
        if self.part == "a1":
            return local_attention(q, k, v, self.stride + 1, causal=True, rel_pos=rel_pos, backend=self.backend)
        return column_attention(q, k, v, self.stride, causal=True, gap=0, scale=self.scale, key_valid=None,
                                rel_pos=rel_pos, executor=get_executor(self.backend, q.device))[0]

    def reference_mask(self, q, k):
        a1, a2 = strided_mask(q.shape[2], self.stride, merged=False, heads=2, device=q.device)
        return {"merged": a1 | a2, "a1": a1, "a2": a2}[self.part]

    def store_size(self, max_len):
        return (min(self.stride + 1, max_len), True) if self.part == "a1" else (max_len, False)

    def step(self, q, cache, t, rel_pos):
        if self.part == "a1":  # the ring holds exactly the last l + 1 positions
            return super().step(q, cache, t, rel_pos)
        l = self.stride  # noqa: E741
        near = 0 if self.part == "a2" else max(0, t - l)  # A1: the last l + 1 positions, [near, t]
        column = slice(t % l, t + 1 if self.part == "a2" else near, l)  # t, t - l, … (before `near` when merged)
        keys, values, positions = cache.keys[:, :, column], cache.values[:, :, column], cache.positions[column]
        if self.part == "merged":  # slot p holds position p: both sets are slices
            recent = slice(near, t + 1)
            keys = torch.cat([keys, cache.keys[:, :, recent]], 2)
            values = torch.cat([values, cache.values[:, :, recent]], 2)
            positions = torch.cat([positions, cache.positions[recent]])
        return self.attend(q, keys, values, positions, t, rel_pos)


def _kind(name: str, part: str, keys, summary: str) -> HeadKind:
    def options(config: Any, heads: int) -> StridedOptions:
        return StridedOptions(within_seq_len(config, "stride", name), part)

    return HeadKind(name, lambda o, heads, head_dim, seed: StridedHeads(heads, head_dim, o.stride, o.part),
                    keys_per_query=keys, options=options, describe=lambda o: f"stride={o.stride}", summary=summary)


KINDS = (
    _kind("strided", "merged", lambda o, n: min(o.stride + 1, n) + n / (2 * o.stride),
          "the last l + 1 positions and every l-th one back (l = stride)"),
    _kind("strided_a1", "a1", lambda o, n: min(o.stride + 1, n), "the last l + 1 positions"),
    _kind("strided_a2", "a2", lambda o, n: n / (2 * o.stride), "every l-th position back"),
)
