"""Longformer heads: a dilated sliding window (one dilation per head) plus global positions.

Decoding keeps a ring buffer of the (window - 1) · max(dilation) + 1 last keys, or every key when global tokens are
configured; a step gathers each head's `window` dilated positions and the global positions, O((window + G)·D) (a
global query attends to every earlier position, O(t·D)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..longformer import longformer_attention
from ..masks import longformer_mask
from .base import HeadGroup, HeadKind
from .common import within_seq_len


@dataclass(frozen=True)
class LongformerOptions:
    window: int  # config.window
    dilation: tuple[int, ...]  # config.dilation: one per head of the group
    global_tokens: tuple[int, ...]  # config.global_tokens


class LongformerHeads(HeadGroup):
    def __init__(self, heads: int, head_dim: int, window: int, dilation: list[int], global_tokens: list[int]) -> None:
        super().__init__(heads, head_dim)
        self.window, self.dilation, self.global_tokens = window, list(dilation), sorted(global_tokens)
        self._is_global = set(self.global_tokens)
        d = torch.tensor(self.dilation, dtype=torch.long)[:, None]  # (h, 1): one dilation per head
        # Decoding index tensors, built once (they follow the module's device; not saved).
        self.register_buffer("_dilation", d, persistent=False)
        self.register_buffer("_offsets", torch.arange(window) * d, persistent=False)  # (h, window): t - offset
        self.register_buffer("_globals", torch.tensor(self.global_tokens, dtype=torch.long), persistent=False)

    def _present(self, n: int) -> list[int]:
        return [g for g in self.global_tokens if g < n]  # a shorter sequence holds fewer of them

    def forward(self, q, k, v, rel_pos):
        present = self._present(q.shape[2])
        return longformer_attention(q, k, v, self.window, self.dilation, present or None, causal=True,
                                    rel_pos=rel_pos, backend=self.backend)

    def reference_mask(self, q, k):
        return longformer_mask(q.shape[2], self.window, self.dilation, self._present(q.shape[2]), causal=True,
                               device=q.device)

    def store_size(self, max_len):
        if self.global_tokens:  # a global position attends to everything before it
            return max_len, False
        return min((self.window - 1) * max(self.dilation) + 1, max_len), True

    def step(self, q, cache, t, rel_pos):
        if t in self._is_global:  # a global query sees every earlier position
            return super().step(q, cache, t, rel_pos)
        positions = t - self._offsets  # (h, window): t, t - d, …, t - (window - 1)·d of each head
        allowed = positions >= 0
        positions = positions.clamp_min(0)
        if self.global_tokens:  # and every earlier global position not already in the head's band
            gap = t - self._globals  # (G,)
            in_band = (gap % self._dilation == 0) & (gap // self._dilation < self.window)  # (h, G)
            positions = torch.cat([positions, self._globals.clamp_max(t).expand(len(self.dilation), -1)], 1)
            allowed = torch.cat([allowed, (gap >= 0) & ~in_band], 1)
        slots = positions % cache.capacity if cache.ring else positions  # a ring holds the whole band
        B, _, _, D = cache.keys.shape
        index = slots[None, :, :, None].expand(B, -1, -1, D)
        return self.attend(q, cache.keys.gather(2, index), cache.values.gather(2, index),
                           positions[None].expand(B, -1, -1), t, rel_pos, allowed=allowed)


def _options(config: Any, heads: int) -> LongformerOptions:
    window = within_seq_len(config, "window", "longformer")
    if isinstance(config.dilation, (list, tuple)):
        if len(config.dilation) != heads:
            raise ValueError(f"dilation gives {len(config.dilation)} values but there are {heads} longformer heads")
        dilation = tuple(config.dilation)
    else:
        dilation = (config.dilation,) * heads
    return LongformerOptions(window, dilation, tuple(config.global_tokens))


KIND = HeadKind(
    "longformer",
    lambda o, heads, head_dim, seed: LongformerHeads(heads, head_dim, o.window, list(o.dilation),
                                                     list(o.global_tokens)),
    keys_per_query=lambda o, n: min(o.window, n) + len(o.global_tokens),
    options=_options,
    describe=lambda o: f"window={o.window}, dilation={list(o.dilation)}, global={list(o.global_tokens)}",
    summary="a dilated window plus global positions",
)
