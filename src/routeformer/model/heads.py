"""Head groups: the heads of one layer that share a mechanism, with their forward and their decoding cache.

Each cache keeps exactly the positions its mechanism can still need, and a decoding step attends to exactly the
positions the forward would have used for that query:
- full: every key (grows);  strided: every key (A2 reaches every earlier position of the query's column);
- local: a ring buffer of the last `window` keys;  routing: a ring buffer of `window` keys per cluster;
- fixed: the summary cells seen so far and the current block;
- longformer: every key when global tokens are configured (a global position attends to everything before it),
  else a ring buffer of the (window - 1) · dilation + 1 last keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention import (
    RelativePositions,
    RoutingAttention,
    RoutingCache,
    full_attention,
    local_attention,
    longformer_attention,
)
from ..attention.decoding import attend_cached
from ..attention.fixed import _summaries, _within_block, fixed_attention
from ..attention.strided import column_attention, strided_attention
from .config import TransformerConfig


@dataclass
class KeyStore:
    """Keys and values of selected positions, in arrival order: (B, H, capacity, D) buffers and their positions.

    ``ring``: capacity slots reused in order (position p in slot p mod capacity); otherwise slots fill once.
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

    def add(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Store k, v (B, H, n, D) of the given positions (n,)."""
        n, cap = positions.numel(), self.positions.numel()
        if n == 0:
            return
        if self.ring:
            if n > cap:  # only the last `capacity` can survive
                k, v, positions = k[:, :, -cap:], v[:, :, -cap:], positions[-cap:]
            slots = positions % cap
            self.count += n
        else:
            if self.count + n > cap:
                raise ValueError(f"max_len: the cache holds {cap} positions and is full")
            slots = torch.arange(self.count, self.count + n, device=k.device)
            self.count += n
        self.keys[:, :, slots] = k.to(self.keys.dtype)
        self.values[:, :, slots] = v.to(self.values.dtype)
        self.positions[slots] = positions


@dataclass
class HeadCache:
    """Decoding state of one head group: the positions seen so far and what the mechanism keeps (key stores, or
    for routing heads the per-cluster ring buffers)."""

    stores: dict[str, KeyStore]
    length: int
    max_len: int
    routing: RoutingCache | None = None

    def check(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ValueError(f"max_len: decoding to position {self.length + n - 1} exceeds the cache's declared "
                             f"max_len={self.max_len}")


class HeadGroup(nn.Module):
    """Some heads of a layer using one mechanism. q, k, v: (B, h, N, D) -> (B, h, N, D)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None) -> Tensor:
        raise NotImplementedError

    def aux_loss(self) -> Tensor | None:
        return None

    # --- decoding -------------------------------------------------------------------------------------------
    def store_layout(self, max_len: int) -> dict[str, tuple[int, bool]]:
        """name -> (capacity, ring) of the key stores this mechanism keeps."""
        return {"all": (max_len, False)}

    def new_cache(self, batch: int, max_len: int, device, dtype) -> HeadCache:
        stores = {name: KeyStore.empty(batch, self.heads, cap, self.head_dim, ring=ring, device=device, dtype=dtype)
                  for name, (cap, ring) in self.store_layout(max_len).items()}
        return HeadCache(stores, 0, max_len)

    def keep(self, cache: HeadCache, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Store what later queries will need of these new positions."""
        cache.stores["all"].add(k, v, positions)

    def needed(self, cache: HeadCache, t: int) -> tuple[KeyStore, Tensor | None]:
        """The store to read for the query at t, and an optional (capacity,) mask of the slots it may see."""
        store = cache.stores["all"]
        return store, store.positions >= 0

    def step(self, q: Tensor, cache: HeadCache, t: int, rel_pos: RelativePositions | None) -> Tensor:
        store, allowed = self.needed(cache, t)
        return attend_cached(q, store.keys, store.values, store.positions, t, scale=self.scale, allowed=allowed,
                             rel_pos=rel_pos)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache: HeadCache,
               rel_pos: RelativePositions | None) -> Tensor:
        """Outputs (B, h, n, D) of n new positions; equal to the causal forward over the whole prefix."""
        n = q.shape[2]
        cache.check(n)
        start = cache.length
        if start == 0 and n > 1:  # a prompt: one forward, then keep what the future needs
            out = self(q, k, v, rel_pos)
            self.keep(cache, k, v, torch.arange(n, device=q.device))
            cache.length = n
            return out
        outs = []
        for i in range(n):
            t = start + i
            self.keep(cache, k[:, :, i:i + 1], v[:, :, i:i + 1], torch.tensor([t], device=q.device))
            cache.length = t + 1
            outs.append(self.step(q[:, :, i], cache, t, rel_pos))
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

    def store_layout(self, max_len):
        return {"recent": (min(self.window, max_len), True)}

    def keep(self, cache, k, v, positions):
        cache.stores["recent"].add(k, v, positions)

    def needed(self, cache, t):
        store = cache.stores["recent"]
        return store, (store.positions >= 0) & (store.positions > t - self.window)


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

    def store_layout(self, max_len):
        if self.part == "a1":
            return {"recent": (min(self.stride + 1, max_len), True)}
        return {"all": (max_len, False)}

    def keep(self, cache, k, v, positions):
        cache.stores["recent" if self.part == "a1" else "all"].add(k, v, positions)

    def needed(self, cache, t):
        store = cache.stores["recent" if self.part == "a1" else "all"]
        pos = store.positions
        near = (pos >= 0) & (pos >= t - self.stride) & (pos <= t)
        column = (pos >= 0) & (pos <= t) & ((t - pos) % self.stride == 0)
        return store, {"merged": near | column, "a1": near, "a2": column}[self.part]


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

    def store_layout(self, max_len):
        cells = max_len // self.block * self.summary + max(0, max_len % self.block - (self.block - self.summary))
        return {"block": (min(self.block, max_len), True), "summary": (max(1, cells), False)}

    def _is_summary(self, positions: Tensor) -> Tensor:
        return positions % self.block >= self.block - self.summary

    def keep(self, cache, k, v, positions):
        cache.stores["block"].add(k, v, positions)
        cells = self._is_summary(positions)
        cache.stores["summary"].add(k[:, :, cells], v[:, :, cells], positions[cells])

    def step(self, q, cache, t, rel_pos):
        own, cells = cache.stores["block"], cache.stores["summary"]
        first = t // self.block * self.block
        in_block = (own.positions >= first) & (own.positions <= t)
        if self.part == "a1":
            return attend_cached(q, own.keys, own.values, own.positions, t, scale=self.scale, allowed=in_block,
                                 rel_pos=rel_pos)
        seen = (cells.positions >= 0) & (cells.positions <= t)
        if self.part == "a2":
            return attend_cached(q, cells.keys, cells.values, cells.positions, t, scale=self.scale, allowed=seen,
                                 rel_pos=rel_pos)
        earlier = seen & (cells.positions < first)  # the own block's summary cells are already in A1
        keys = torch.cat([own.keys, cells.keys], 2)
        values = torch.cat([own.values, cells.values], 2)
        return attend_cached(q, keys, values, torch.cat([own.positions, cells.positions]), t, scale=self.scale,
                             allowed=torch.cat([in_block, earlier]), rel_pos=rel_pos)


class LongformerHeads(HeadGroup):
    def __init__(self, heads: int, head_dim: int, window: int, dilation: list[int], global_tokens: list[int]) -> None:
        super().__init__(heads, head_dim)
        self.window, self.dilation, self.global_tokens = window, dilation, sorted(global_tokens)

    def forward(self, q, k, v, rel_pos):
        present = [g for g in self.global_tokens if g < q.shape[2]]  # a shorter sequence holds fewer of them
        return longformer_attention(q, k, v, self.window, self.dilation, present or None, causal=True,
                                    rel_pos=rel_pos)

    def store_layout(self, max_len):
        if self.global_tokens:
            return {"all": (max_len, False)}
        return {"recent": (min((self.window - 1) * max(self.dilation) + 1, max_len), True)}

    def keep(self, cache, k, v, positions):
        cache.stores["recent" if "recent" in cache.stores else "all"].add(k, v, positions)

    def needed(self, cache, t):
        store = cache.stores["recent" if "recent" in cache.stores else "all"]
        pos = store.positions
        seen = (pos >= 0) & (pos <= t)
        if t in self.global_tokens:  # a global query sees every earlier position
            return store, seen
        d = torch.tensor(self.dilation, device=pos.device)[None, :, None]  # (1, h, 1): one dilation per head
        band = seen[None, None] & ((t - pos) % d == 0) & ((t - pos) // d < self.window)
        glob = seen & torch.isin(pos, torch.tensor(self.global_tokens, device=pos.device, dtype=torch.long))
        return store, band | glob[None, None]


class RoutingHeads(HeadGroup):
    """Routing heads; with shared QK the model passes the queries as keys."""

    def __init__(self, heads: int, head_dim: int, config: TransformerConfig, seed: int) -> None:
        super().__init__(heads, head_dim)
        self.routing = RoutingAttention(heads, head_dim, config.num_clusters, config.routing_window, causal=True,
                                        shared_qk=config.shared_qk, decay=config.kmeans_decay,
                                        commitment=config.commitment, seed=seed)

    def forward(self, q, k, v, rel_pos):
        return self.routing(q, k, v, rel_pos=rel_pos)

    def aux_loss(self) -> Tensor | None:
        return self.routing.commitment_loss

    def new_cache(self, batch, max_len, device, dtype):
        return HeadCache({}, 0, max_len, routing=self.routing.new_cache(batch, max_len, device=device, dtype=dtype))

    def decode(self, q, k, v, cache, rel_pos):
        cache.check(q.shape[2])
        out = self.routing.decode(q, k, v, cache.routing, rel_pos=rel_pos)
        cache.length = cache.routing.length
        return out


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
