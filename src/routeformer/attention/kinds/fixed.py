"""Fixed heads (Sparse Transformer): the own block of l = block positions (A1) and the last c = summary positions of
every block (A2).

Three kinds: 'fixed' (A1 ∪ A2), 'fixed_a1' and 'fixed_a2' (one set each), as for strided heads.

Decoding keeps one buffer holding a ring of the current block beside the summary cells so far; a step reads the
block and the earlier blocks' summary cells as one slice, O((l + t·c/l)·D) (a1: O(l·D); a2: O(t·c/l·D)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..executors import get_executor
from ..fixed import _summaries, _within_block, fixed_attention, summary_count
from ..masks import fixed_mask
from .base import HeadGroup, HeadKind, KeyStore
from .common import within_seq_len


@dataclass(frozen=True)
class FixedOptions:
    block: int  # config.block: l
    summary: int  # config.summary: c <= l
    part: str  # 'merged', 'a1' or 'a2'


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
            return fixed_attention(q, k, v, self.block, self.summary, causal=True, rel_pos=rel_pos,
                                   backend=self.backend)
        common = {"causal": True, "scale": self.scale, "key_valid": None, "rel_pos": rel_pos,
                  "executor": get_executor(self.backend, q.device)}
        if self.part == "a1":
            return _within_block(q, k, v, self.block, **common)[0]
        return _summaries(q, k, v, self.block, self.summary, other_blocks=False, **common)[0]

    def reference_mask(self, q, k):
        a1, a2 = fixed_mask(q.shape[2], self.block, self.summary, merged=False, heads=2, device=q.device)
        return {"merged": a1 | a2, "a1": a1, "a2": a2}[self.part]

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


def _kind(name: str, part: str, keys, summary: str) -> HeadKind:
    def options(config: Any, heads: int) -> FixedOptions:
        return FixedOptions(within_seq_len(config, "block", name), config.summary, part)

    return HeadKind(name, lambda o, heads, head_dim, seed: FixedHeads(heads, head_dim, o.block, o.summary, o.part),
                    keys_per_query=keys, options=options, describe=lambda o: f"block={o.block}, summary={o.summary}",
                    summary=summary)


KINDS = (
    _kind("fixed", "merged", lambda o, n: min(o.block, n) / 2 + n * o.summary / (2 * o.block),
          "the own block and the summary cells of every block"),
    _kind("fixed_a1", "a1", lambda o, n: min(o.block, n) / 2, "the own block"),
    _kind("fixed_a2", "a2", lambda o, n: n * o.summary / (2 * o.block), "the summary cells of every block"),
)
