"""Block masks from a pattern's reach, without evaluating all Nq · Nk pairs.

A query block [q0, q1] may only see keys in the pattern's ``reach(q0, q1)``; the key blocks of that range are the
candidates (a few per query block for a band: O(N · reach) work, not O(N²)). The exact rule is evaluated on the
candidates alone (in chunks of query blocks, so at most about 2^24 pairs at once): a candidate where no pair is
allowed is dropped, one where every pair is allowed is a *full* block (the kernel skips ``mask_mod`` there), the
rest are partial. Everything is tensor operations (the reach on the host, the rule on the queries' device),
with no Python loop per block or step and no device-to-host read. Static patterns (no data masks) are cached by
their ``cache_key`` and sizes; routing's masks, which change with every batch, are built per call.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from .pattern import FlexPattern

BLOCK = 128  # FlexAttention's default sparse block size
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 64
_CHUNK = 1 << 24  # pairs evaluated at once


def block_mask(pattern: FlexPattern, batch: int, heads: int, device: torch.device,
               block: tuple[int, int] = (BLOCK, BLOCK)):
    """The ``BlockMask`` of ``pattern`` for (batch, heads) and (query, key) blocks of ``block`` positions."""
    key = None
    if pattern.cache_key is not None and not pattern.per_head:
        key = (pattern.cache_key, pattern.nq, pattern.nk, str(device), block)
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    mask = _build(pattern, batch if pattern.per_head else 1, heads if pattern.per_head else 1, device, block)
    if key is not None:
        _CACHE[key] = mask
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return mask


def _build(pattern: FlexPattern, B: int, H: int, device: torch.device, block: tuple[int, int]):
    from torch.nn.attention.flex_attention import BlockMask

    bq, bk = block
    nq_blocks, nk_blocks = -(-pattern.nq // bq), -(-pattern.nk // bk)
    cand, in_reach = _candidates(pattern, bq, bk)
    width = cand.shape[1]
    # non_blocking: a blocking copy to CUDA ends in a stream synchronisation (PyTorch's memcpy_and_sync); from
    # pageable host memory the copy is staged before the call returns, so the host tensors may go at once
    cand, in_reach = cand.to(device, non_blocking=True), in_reach.to(device, non_blocking=True)

    b = torch.arange(B, device=device).view(B, 1, 1, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1, 1, 1)
    rows = torch.arange(bq, device=device).view(1, 1, 1, 1, bq, 1)
    cols = torch.arange(bk, device=device).view(1, 1, 1, 1, 1, bk)
    step = max(1, _CHUNK // (B * H * width * bq * bk))
    any_parts, all_parts = [], []
    for start in range(0, nq_blocks, step):  # chunks of query blocks: bounded memory, not a loop per block
        qb = torch.arange(start, min(start + step, nq_blocks), device=device)
        i = qb.view(1, 1, -1, 1, 1, 1) * bq + rows  # (1, 1, c, 1, bq, 1)
        j = cand[qb].view(1, 1, -1, width, 1, 1) * bk + cols  # (1, 1, c, C, 1, bk)
        real = (i < pattern.nq) & (j < pattern.nk)  # pairs inside the sequences
        allowed = pattern.allowed(b, h, i, j) & real
        any_parts.append(allowed.flatten(-2).any(-1))
        all_parts.append((allowed | ~real).flatten(-2).all(-1))
    some = torch.cat(any_parts, 2) & in_reach  # (B, H, nqb, C)
    every = torch.cat(all_parts, 2) & some
    partial = some & ~every
    kv_num, kv_idx = _ordered(partial, cand, nk_blocks)
    full_num, full_idx = _ordered(every, cand, nk_blocks)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=pattern.allowed, seq_lengths=(pattern.nq, pattern.nk))


def _candidates(pattern: FlexPattern, bq: int, bk: int) -> tuple[Tensor, Tensor]:
    """(cand, in_reach) (nqb, C) on the host: the key blocks each query block's reach covers (clamped to the last
    block) and whether each is within it. The reach is arithmetic on block numbers, tensors on the host made here:
    reading the width C is a host read of a host tensor, never a wait for the device, and C depends only on the
    pattern's reach and sizes (not on the data), so the block mask's shapes do too."""
    nq_blocks, nk_blocks = -(-pattern.nq // bq), -(-pattern.nk // bk)
    first = torch.arange(nq_blocks) * bq
    last = (first + bq - 1).clamp(max=pattern.nq - 1)
    lo, hi = pattern.reach(first, last)
    lo_block = lo.clamp(0, pattern.nk - 1) // bk  # (nqb,)
    hi_block = hi.clamp(0, pattern.nk - 1) // bk
    width = int((hi_block - lo_block).max()) + 1  # candidates per query block
    cand = lo_block[:, None] + torch.arange(width)  # (nqb, C)
    return cand.clamp(max=nk_blocks - 1), cand <= hi_block[:, None]


def _ordered(chosen: torch.Tensor, cand: torch.Tensor, nk_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (B, H, nqb), indices (B, H, nqb, nkb)) of the chosen candidate blocks, listed first in key order."""
    B, H, nqb, width = chosen.shape
    keyed = torch.where(chosen, cand.expand(B, H, nqb, width), nk_blocks)  # unchosen sort last
    idx = keyed.sort(-1).values.clamp(max=nk_blocks - 1)
    idx = torch.nn.functional.pad(idx, (0, nk_blocks - width))  # FlexAttention wants one column per key block
    return chosen.sum(-1).to(torch.int32), idx.to(torch.int32).contiguous()
