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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import positive_int
from ..executors.inputs import check_inputs
from ..executors.relative import RelativePositions
from .blocks import (
    BlockCache,
    BlockHeads,
    allowed_keys,
    block_means,
    dense_warmup,
    describe_warmup,
    select_blocks,
    selected_attention,
    selected_mask,
    selection_keys,
    warmup_length,
)
from .full import full_attention
from .kinds.base import HeadKind
from .kinds.common import at_most_seq_len, non_negative_int


def default_block(seq_len: int, top_k: int) -> int:
    """The block that gives routing's default cost, top_k · block ≈ 2 · sqrt(seq_len) selected keys per query."""
    return max(1, min(seq_len, round(2 * math.sqrt(seq_len) / top_k)))


@dataclass(frozen=True)
class MobaOptions:
    """options.moba: the block size (None: ``default_block``), the blocks each query selects, and an optional dense
    warm-up (steps, and the length of the sequences it trains on; None: the model's)."""

    block: int | None = None
    top_k: int = 3
    warmup: int = 0
    warmup_len: int | None = None

    def __post_init__(self) -> None:
        if self.block is not None:
            positive_int("block", self.block)
        positive_int("top_k", self.top_k)
        non_negative_int("warmup", self.warmup)
        if self.warmup_len is not None:
            positive_int("warmup_len", self.warmup_len)


class MobaHeads(BlockHeads):
    """Block-selecting heads (see the module). q, k, v: (B, h, N, D) -> (B, h, N, D). The decoding cache keeps the
    mean key of each block (``BlockCache``)."""

    def __init__(self, heads: int, head_dim: int, options: MobaOptions) -> None:
        super().__init__(heads, head_dim, options.block, options.warmup)
        self.options = options
        self.top_k = options.top_k

    def summarise(self, keys: Tensor, values: Tensor) -> tuple[Tensor]:
        return (block_means(keys, self.block),)

    def select(self, q: Tensor, k: Tensor) -> Tensor:
        """(B, h, N, top_k) long: every query's selected blocks, best first (``blocks.NONE`` for missing ones)."""
        means = block_means(k, self.block)  # (B, h, N // block, D)
        scores = torch.einsum("bhnd,bhmd->bhnm", q, means.to(q.dtype))  # (B, h, N, N // block)
        return select_blocks(scores, self.block, self.top_k)

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

    # --- decoding -------------------------------------------------------------------------------------------
    def step(self, q: Tensor, cache: BlockCache, t: int, rel_pos: RelativePositions | None) -> Tensor:
        keys, values, positions = cache.filled()
        if self.warming_up:
            return self.attend(q, keys, values, positions, t, rel_pos)
        (means,) = cache.before(t)  # the complete blocks before t's own
        scores = torch.einsum("bhd,bhmd->bhm", q.to(means.dtype), means)[:, :, None]  # (B, h, 1, m)
        chosen = select_blocks(scores, self.block, self.top_k, torch.full((1,), t, device=q.device))[:, :, 0]
        return self.attend(q, keys, values, positions, t, rel_pos,
                           allowed=allowed_keys(chosen, self.block, t, positions))

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, block={self.block}, top_k={self.top_k}"
                + (f", warmup={self.warmup}" if self.warmup else "") + f", executor={self.executor.name}")


# --- the head kind: how a model uses it ---


def _complete(o: MobaOptions, config: Any) -> MobaOptions:
    block = default_block(config.seq_len, o.top_k) if o.block is None else o.block
    at_most_seq_len("block", block, config)
    return dataclasses.replace(o, block=block, warmup_len=warmup_length(o.warmup_len, o.warmup, config))


def keys_per_query(o: MobaOptions, n: int) -> float:
    """Selected keys (top_k blocks of an average query, its own block half full) plus the block means it scores."""
    return selection_keys(o.block, o.top_k, n)


KIND = HeadKind("moba", lambda o, heads, head_dim, seed: MobaHeads(heads, head_dim, o), keys_per_query=keys_per_query,
                warmup=dense_warmup, option_type=MobaOptions, complete=_complete,
                describe=lambda o: f"block={o.block}, top_k={o.top_k}" + describe_warmup(o),
                summary="the `top_k` earlier blocks whose mean key the query scores highest, and its own block")

__all__ = ["KIND", "MobaHeads", "MobaOptions", "default_block"]
