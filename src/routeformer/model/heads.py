"""Head groups: the heads of one layer that share a mechanism, with their forward and their decoding cache.

Each cache keeps exactly the positions its mechanism can still need, and a decoding step reads only the keys the
forward would have used for that query (t: the query's position; D: head width; per head):
- full: every key; a step reads the filled part, O(t·D).
- local: a ring buffer of the last `window` keys, O(window·D).
- strided: every key (slot p holds position p; A2 reaches back to the start); a step slices the query's column
  t, t - l, t - 2l, … and the last l + 1 positions, O((l + t/l)·D) (a1: a ring of l + 1, O(l·D); a2: O(t/l·D)).
- fixed: one buffer holding a ring of the current block beside the summary cells so far; a step reads the block
  and the earlier blocks' summary cells as one slice, O((l + t·c/l)·D) (a1: O(l·D); a2: O(t·c/l·D)).
- longformer: a ring buffer of the (window - 1) · max(dilation) + 1 last keys, or every key when global tokens
  are configured; a step gathers each head's `window` dilated positions and the global positions, O((window + G)·D)
  (a global query attends to every earlier position, O(t·D)).
- routing: a ring buffer of `window` keys per cluster (routing/cache.py), O(k·D + window·D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention import (
    RelativePositions,
    RoutingAttention,
    full_attention,
    local_attention,
    longformer_attention,
)
from ..attention.decoding import attend_cached
from ..attention.fixed import _summaries, _within_block, fixed_attention, summary_count
from ..attention.strided import column_attention, strided_attention
from .config import TransformerConfig


@dataclass
class KeyStore:
    """Keys and values of selected positions: (B, H, capacity, D) buffers and their positions (capacity,).

    Positions arrive in increasing order from position 0 (a model's cache always starts there). ``ring``: position
    p goes to slot p mod capacity (every position passes through a ring); otherwise slots fill once, in arrival
    order. Either way the filled slots are the first min(count, capacity).
    """

    keys: Tensor
    values: Tensor
    positions: Tensor  # (capacity,), -1 for an empty slot
    ring: bool
    count: int = 0

    @classmethod
    def empty(cls, batch: int, heads: int, capacity: int, head_dim: int, *, ring: bool, device, dtype) -> KeyStore:
        return cls(torch.zeros(batch, heads, capacity, head_dim, device=device, dtype=dtype),
                   torch.zeros(batch, heads, capacity, head_dim, device=device, dtype=dtype),
                   torch.full((capacity,), -1, dtype=torch.long, device=device), ring)

    @property
    def capacity(self) -> int:
        return self.positions.numel()

    def add(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Store k, v (B, H, n, D) of the given increasing positions (n,)."""
        n, cap = positions.numel(), self.capacity
        if n == 0:
            return
        if self.ring:
            if n > cap:  # only the last `capacity` can survive
                k, v, positions = k[:, :, -cap:], v[:, :, -cap:], positions[-cap:]
            slots = positions % cap
        else:
            if self.count + n > cap:
                raise ValueError(f"max_len: the cache holds {cap} positions and is full")
            slots = slice(self.count, self.count + n)
        self.keys[:, :, slots] = k.to(self.keys.dtype)
        self.values[:, :, slots] = v.to(self.values.dtype)
        self.positions[slots] = positions
        self.count += n

    def filled(self) -> tuple[Tensor, Tensor, Tensor]:
        """Keys, values (B, H, m, D) and positions (m,) of the filled slots (views, no copy)."""
        m = min(self.count, self.capacity)
        return self.keys[:, :, :m], self.values[:, :, :m], self.positions[:m]


class HeadGroup(nn.Module):
    """Some heads of a layer using one mechanism. q, k, v: (B, h, N, D) -> (B, h, N, D).

    Decoding: ``new_cache`` makes the group's cache (by default one ``KeyStore`` of ``store_size``), ``keep``
    stores what later queries need of new positions, ``step`` is the output of the query at position t.
    """

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None) -> Tensor:
        raise NotImplementedError

    def aux_loss(self) -> Tensor | None:
        return None

    # --- decoding -------------------------------------------------------------------------------------------
    def store_size(self, max_len: int) -> tuple[int, bool]:
        """(capacity, ring) of the key store: by default every position, filled once."""
        return max_len, False

    def new_cache(self, batch: int, max_len: int, device, dtype):
        capacity, ring = self.store_size(max_len)
        return KeyStore.empty(batch, self.heads, capacity, self.head_dim, ring=ring, device=device, dtype=dtype)

    def keep(self, cache, k: Tensor, v: Tensor, positions: Tensor, start: int) -> None:
        """Store what later queries will need of the new positions start, start + 1, … (``positions``)."""
        cache.add(k, v, positions)

    def step(self, q: Tensor, cache, t: int, rel_pos: RelativePositions | None) -> Tensor:
        """Output (B, h, D) of the query at t. Default: every filled slot (a ring then holds just what t sees)."""
        return self.attend(q, *cache.filled(), t, rel_pos)

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, t: int,
               rel_pos: RelativePositions | None, allowed: Tensor | None = None) -> Tensor:
        return attend_cached(q, keys, values, positions, t, scale=self.scale, allowed=allowed, rel_pos=rel_pos)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache, start: int,
               rel_pos: RelativePositions | None) -> Tensor:
        """Outputs (B, h, n, D) of n new positions from ``start`` on; equal to the causal forward over the whole
        prefix. The caller checks that they fit the cache."""
        n = q.shape[2]
        positions = torch.arange(start, start + n, device=q.device)
        if start == 0 and n > 1:  # a prompt: one forward, then keep what the future needs
            out = self(q, k, v, rel_pos)
            self.keep(cache, k, v, positions, start)
            return out
        outs = []
        for i in range(n):
            self.keep(cache, k[:, :, i:i + 1], v[:, :, i:i + 1], positions[i:i + 1], start + i)
            outs.append(self.step(q[:, :, i], cache, start + i, rel_pos))
        return torch.stack(outs, 2)


class FullHeads(HeadGroup):
    def forward(self, q, k, v, rel_pos):
        return full_attention(q, k, v, causal=True, rel_pos=rel_pos)


class LocalHeads(HeadGroup):
    def __init__(self, heads: int, head_dim: int, window: int) -> None:
        super().__init__(heads, head_dim)
        self.window = window

    def forward(self, q, k, v, rel_pos):
        return local_attention(q, k, v, self.window, causal=True, rel_pos=rel_pos)

    def store_size(self, max_len):
        return min(self.window, max_len), True  # the ring holds exactly the window


class StridedHeads(HeadGroup):
    """part: 'merged' (A1 ∪ A2), 'a1' (the last l + 1 positions) or 'a2' (every l-th position back)."""

    def __init__(self, heads: int, head_dim: int, stride: int, part: str) -> None:
        super().__init__(heads, head_dim)
        self.stride, self.part = stride, part

    def forward(self, q, k, v, rel_pos):
        if self.part == "merged":
            return strided_attention(q, k, v, self.stride, causal=True, rel_pos=rel_pos)
        if self.part == "a1":
            return local_attention(q, k, v, self.stride + 1, causal=True, rel_pos=rel_pos)
        return column_attention(q, k, v, self.stride, causal=True, gap=0, scale=self.scale, key_valid=None,
                                rel_pos=rel_pos)[0]

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


@dataclass
class FixedCache:
    """Fixed heads' decoding state: one buffer of [a ring of the current block | the summary cells in order];
    ``block`` and ``summary`` are stores over its two parts (views; None when the part needs none)."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    block: KeyStore | None
    summary: KeyStore | None


class FixedHeads(HeadGroup):
    """part: 'merged' (A1 ∪ A2), 'a1' (the own block) or 'a2' (summary cells)."""

    def __init__(self, heads: int, head_dim: int, block: int, summary: int, part: str) -> None:
        super().__init__(heads, head_dim)
        self.block, self.summary, self.part = block, summary, part

    def forward(self, q, k, v, rel_pos):
        if self.part == "merged":
            return fixed_attention(q, k, v, self.block, self.summary, causal=True, rel_pos=rel_pos)
        common = {"causal": True, "scale": self.scale, "key_valid": None, "rel_pos": rel_pos}
        if self.part == "a1":
            return _within_block(q, k, v, self.block, **common)[0]
        return _summaries(q, k, v, self.block, self.summary, other_blocks=False, **common)[0]

    def new_cache(self, batch, max_len, device, dtype):
        own = 0 if self.part == "a2" else min(self.block, max_len)
        cells = 0 if self.part == "a1" else max(1, summary_count(max_len, self.block, self.summary))
        joint = KeyStore.empty(batch, self.heads, own + cells, self.head_dim, ring=False, device=device, dtype=dtype)

        def part(slots: slice, ring: bool) -> KeyStore:
            return KeyStore(joint.keys[:, :, slots], joint.values[:, :, slots], joint.positions[slots], ring)

        return FixedCache(joint.keys, joint.values, joint.positions, part(slice(0, own), True) if own else None,
                          part(slice(own, None), False) if cells else None)

    def keep(self, cache, k, v, positions, start):
        if cache.block is not None:
            cache.block.add(k, v, positions)
        if cache.summary is not None:
            first_cell = self.block - self.summary
            if positions.numel() == 1:  # decided on the host: no device sync per token
                if start % self.block >= first_cell:
                    cache.summary.add(k, v, positions)
            else:
                cells = positions % self.block >= first_cell
                cache.summary.add(k[:, :, cells], v[:, :, cells], positions[cells])

    def step(self, q, cache, t, rel_pos):
        if self.part == "a2":  # the summary cells so far, the own block's included
            return self.attend(q, *cache.summary.filled(), t, rel_pos)
        first = t - t % self.block  # the own block starts here
        if self.part == "a1":
            keys, values, positions = cache.block.filled()
            return self.attend(q, keys, values, positions, t, rel_pos, allowed=positions >= first)
        # merged: the block ring and the earlier blocks' summary cells (the own block's are in A1) are one slice
        own = cache.block.capacity
        m = own + summary_count(first, self.block, self.summary)
        positions = cache.positions[:m]
        allowed = positions >= first  # in the ring: the own block (empty slots hold -1)
        allowed[own:] = True
        return self.attend(q, cache.keys[:, :, :m], cache.values[:, :, :m], positions, t, rel_pos, allowed=allowed)


class LongformerHeads(HeadGroup):
    def __init__(self, heads: int, head_dim: int, window: int, dilation: list[int], global_tokens: list[int]) -> None:
        super().__init__(heads, head_dim)
        self.window, self.dilation, self.global_tokens = window, dilation, sorted(global_tokens)
        self._is_global = set(self.global_tokens)
        d = torch.tensor(dilation, dtype=torch.long)[:, None]  # (h, 1): one dilation per head
        # Decoding index tensors, built once (they follow the module's device; not saved).
        self.register_buffer("_dilation", d, persistent=False)
        self.register_buffer("_offsets", torch.arange(window) * d, persistent=False)  # (h, window): t - offset
        self.register_buffer("_globals", torch.tensor(self.global_tokens, dtype=torch.long), persistent=False)

    def forward(self, q, k, v, rel_pos):
        present = [g for g in self.global_tokens if g < q.shape[2]]  # a shorter sequence holds fewer of them
        return longformer_attention(q, k, v, self.window, self.dilation, present or None, causal=True,
                                    rel_pos=rel_pos)

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


class RoutingHeads(HeadGroup):
    """Routing heads; with shared QK the model passes the queries as keys."""

    def __init__(self, heads: int, head_dim: int, config: TransformerConfig, seed: int) -> None:
        super().__init__(heads, head_dim)
        self.routing = RoutingAttention(heads, head_dim, config.num_clusters, config.routing_window, causal=True,
                                        shared_qk=config.shared_qk, separate=config.separate_routing,
                                        decay=config.kmeans_decay,
                                        commitment=config.commitment, seed=seed)

    def forward(self, q, k, v, rel_pos):
        return self.routing(q, k, v, rel_pos=rel_pos)

    def aux_loss(self) -> Tensor | None:
        return self.routing.commitment_loss

    def new_cache(self, batch, max_len, device, dtype):
        return self.routing.new_cache(batch, None, device=device, dtype=dtype)  # the model checks max_len

    def decode(self, q, k, v, cache, start, rel_pos):
        return self.routing.decode(q, k, v, cache, rel_pos=rel_pos)


def build_heads(name: str, heads: int, config: TransformerConfig, dilation: list[int], seed: int) -> HeadGroup:
    """The head group of mechanism ``name`` with ``heads`` heads, configured from ``config``."""
    D = config.head_dim
    if name == "full":
        return FullHeads(heads, D)
    if name == "local":
        return LocalHeads(heads, D, config.window)
    if name == "routing":
        return RoutingHeads(heads, D, config, seed)
    if name.startswith("strided"):
        return StridedHeads(heads, D, config.stride, name.partition("_")[2] or "merged")
    if name.startswith("fixed"):
        return FixedHeads(heads, D, config.block, config.summary, name.partition("_")[2] or "merged")
    if name == "longformer":
        return LongformerHeads(heads, D, config.window, dilation, config.global_tokens)
    raise ValueError(f"unknown mechanism {name!r}")
