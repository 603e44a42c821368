"""MoBA, mixture of block attention (Lu et al. 2025): each query selects the ``top_k`` earlier blocks of keys whose
mean key it scores highest, and attends to them and to its own block up to itself.

This module is the mechanism's one home: its head kind, options and decoding, registered in ``registry.py``; the
selection and its ranges are ``blocks.py`` (shared with the NSA-style kind).

Heads. The keys are cut into blocks of ``block``. Query i scores every complete block before its own by q_i · mean
key (MoBA's parameter-free gate: the loss trains the selection only through the keys' and queries' use in the
attention) and takes its ``top_k`` best, then one softmax over their keys and its own block's keys j <= i: causal by
construction. Per query (top_k + 1) · block keys at most, plus N / block block scores: O(N · (top_k · block + N /
block) · D) per head, O(N^1.5 · D) with block ~ sqrt(N). An optional dense warm-up (``warmup`` optimiser steps of
full causal attention, on sequences of ``warmup_len``) is the recipe routing's recall study found decisive.

Decoding keeps every key and value (a selected block may be any earlier one) and the mean key of each block, written
once when its last key arrives: a new token costs O(N / block · D + (top_k + 1) · block · D) per head.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..checks import positive_int
from ..executors.inputs import Inputs, check_inputs
from ..executors.relative import RelativePositions
from .blocks import (allowed_keys, block_scores, complete_blocks, select_blocks, selected_attention, selected_mask,
                     summarise)
from .full import full_attention
from .kinds.base import HeadGroup, HeadKind, KeyStore, Warmup
from .kinds.common import at_most_seq_len, non_negative_int


SCORES = ("mean", "bound")


def default_block(seq_len: int, top_k: int) -> int:
    """The block that gives routing's default cost, top_k · block ≈ 2 · sqrt(seq_len) selected keys per query."""
    return max(1, min(seq_len, round(2 * math.sqrt(seq_len) / top_k)))


@dataclass(frozen=True)
class MobaOptions:
    """options.moba: the block size (None: ``default_block``), the blocks each query selects, how a block is scored
    ('mean': q · its mean key, MoBA's; 'bound': an upper bound of q · k over its keys, Quest's; see
    ``blocks.block_scores``), and an optional dense warm-up (steps, and the length of the sequences it trains on;
    None: the model's)."""

    block: int | None = None
    top_k: int = 3
    score: str = "mean"
    warmup: int = 0
    warmup_len: int | None = None

    def __post_init__(self) -> None:
        if self.block is not None:
            positive_int("block", self.block)
        positive_int("top_k", self.top_k)
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(map(repr, SCORES))}, got {self.score!r}")
        non_negative_int("warmup", self.warmup)
        if self.warmup_len is not None:
            positive_int("warmup_len", self.warmup_len)


class BlockCache:
    """Decoding state of block-selecting heads: every key and value (``KeyStore``) and the summary of each complete
    block (B, H, max_len // block, S) by ``summary`` ((B, H, block, D) keys -> (B, H, S)), written when the block's
    last key is kept."""

    def __init__(self, store: KeyStore, block: int, summary: Callable[[Tensor], Tensor]) -> None:
        B, H, capacity, D = store.keys.shape
        self.store, self.block, self.summary = store, block, summary
        size = summary(store.keys[:, :, :1]).shape[-1]
        self.summaries = store.keys.new_zeros(B, H, capacity // block, size)

    @property
    def count(self) -> int:
        return self.store.count

    def add(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        before = self.store.count
        self.store.add(k, v, positions)
        b = self.block
        for j in range(before // b, self.store.count // b):  # the blocks these positions completed
            self.summaries[:, :, j] = self.summary(self.store.keys[:, :, j * b:(j + 1) * b])

    def filled(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.store.filled()


class MobaHeads(HeadGroup):
    """Block-selecting heads (see the module). q, k, v: (B, h, N, D) -> (B, h, N, D)."""

    def __init__(self, heads: int, head_dim: int, options: MobaOptions) -> None:
        super().__init__(heads, head_dim)
        self.options = options
        self.block, self.top_k, self.score, self.warmup = options.block, options.top_k, options.score, options.warmup
        # optimiser steps taken, for the warm-up: a buffer so that a saved run resumes in the same phase, and a
        # python mirror so that a forward decides its mode without reading a tensor (a host sync on a GPU)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self._steps = 0

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._steps = int(self.steps)

    @property
    def warming_up(self) -> bool:
        """Whether the heads still attend to every earlier key (their first ``warmup`` optimiser steps)."""
        return self._steps < self.warmup

    def after_optimizer_step(self, step: int | None, group: dist.ProcessGroup | None) -> bool:
        if self._steps >= self.warmup:
            return False
        self.steps += 1
        self._steps += 1
        return True

    def select(self, q: Tensor, k: Tensor) -> Tensor:
        """(B, h, N, top_k) long: every query's selected blocks, best first (``blocks.NONE`` for missing ones)."""
        summaries = summarise(complete_blocks(k, self.block), self.score)  # (B, h, N // block, D or 2D)
        return select_blocks(block_scores(q, summaries, self.score), self.block, self.top_k)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None) -> Tensor:
        if self.warming_up:
            return full_attention(q, k, v, causal=True, rel_pos=rel_pos, backend=self.executor)
        inputs = check_inputs(q, k, v, None, None, rel_pos)
        with torch.no_grad():  # the selection is discrete: the loss reaches it only through the attention
            chosen = self.select(q, k)
        out, _ = selected_attention(inputs, chosen, self.block, self.executor, rel_pos)
        return out

    def reference_mask(self, q: Tensor, k: Tensor) -> Tensor:
        n = q.shape[2]
        if self.warming_up:
            return torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return selected_mask(self.select(q, k), self.block)

    def reach(self, q: Tensor, k: Tensor, rows: Tensor, cols: Tensor, sources: Tensor) -> dict[str, Tensor]:
        """How often the key at ``sources`` is seen by the query at (``rows``, ``cols``) ('in_window': in a
        selected block or its own block's causal part; mean over heads), the recall benchmark's diagnostic."""
        if self.warming_up:
            return {}
        chosen = self.select(q, k)[rows, :, cols]  # (S, H, top_k)
        home = (sources // self.block)[:, None]  # (S, 1): the needed key's block
        own = (home == (cols // self.block)[:, None]) & (sources <= cols)[:, None]
        seen = (chosen == home[..., None]).any(-1) | own
        return {"in_window": seen.float().mean()}

    # --- decoding -------------------------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int, device, dtype) -> BlockCache:
        return BlockCache(KeyStore.empty(batch, self.heads, max_len, self.head_dim, ring=False, device=device,
                                         dtype=dtype), self.block, lambda keys: summarise(keys, self.score))

    def step(self, q: Tensor, cache: BlockCache, t: int, rel_pos: RelativePositions | None) -> Tensor:
        keys, values, positions = cache.filled()
        if self.warming_up:
            return self.attend(q, keys, values, positions, t, rel_pos)
        summaries = cache.summaries[:, :, :t // self.block]  # the complete blocks before t's own
        scores = block_scores(q[:, :, None].to(summaries.dtype), summaries, self.score)  # (B, h, 1, m)
        chosen = select_blocks(scores, self.block, self.top_k, torch.full((1,), t, device=q.device))[:, :, 0]
        return self.attend(q, keys, values, positions, t, rel_pos,
                           allowed=allowed_keys(chosen, self.block, t, positions))

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, block={self.block}, top_k={self.top_k}, score={self.score}"
                + (f", warmup={self.warmup}" if self.warmup else "") + f", executor={self.executor.name}")


# --- the head kind: how a model uses it ---


def _complete(o: MobaOptions, config: Any) -> MobaOptions:
    block = default_block(config.seq_len, o.top_k) if o.block is None else o.block
    at_most_seq_len("block", block, config)
    length = o.warmup_len
    if length is not None:
        if length > config.seq_len or config.seq_len % length:
            raise ValueError(f"warmup_len ({length}) must divide seq_len ({config.seq_len}): the warm-up trains on "
                             f"each sequence cut into pieces that long")
        length = length if o.warmup else None  # without a warm-up it has nothing to set
    return dataclasses.replace(o, block=block, warmup_len=length)


def keys_per_query(o: MobaOptions, n: int) -> float:
    """Selected keys (top_k blocks of an average query, its own block half full) plus the blocks it scores (a
    'bound' summary is two vectors)."""
    earlier = torch.arange(n, dtype=torch.float64) // o.block  # complete blocks before each query's own
    return float(earlier.clamp(max=o.top_k).mean() * o.block + (min(o.block, n) + 1) / 2
                 + earlier.mean() * (2 if o.score == "bound" else 1))


def _warmup(o: MobaOptions) -> Warmup:
    return Warmup(o.warmup, lambda n: (n + 1) / 2, o.warmup_len)


def _describe(o: MobaOptions) -> str:
    text = f"block={o.block}, top_k={o.top_k}" + ("" if o.score == "mean" else f", score={o.score}")
    if o.warmup:
        text += f", warm-up={o.warmup}" + (f" at length {o.warmup_len}" if o.warmup_len is not None else "")
    return text


KIND = HeadKind("moba", lambda o, heads, head_dim, seed: MobaHeads(heads, head_dim, o), keys_per_query=keys_per_query,
                warmup=_warmup, option_type=MobaOptions, complete=_complete, describe=_describe,
                summary="the `top_k` earlier blocks whose mean key the query scores highest, and its own block")

__all__ = ["KIND", "BlockCache", "MobaHeads", "MobaOptions", "default_block"]
