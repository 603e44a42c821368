"""Block masks from a pattern's reach, without evaluating all Nq · Nk pairs.

A query block [q0, q1] may only see keys in the pattern's ``reach(q0, q1)``; the key blocks of that range are the
candidates (a few per query block for a band: O(N · reach) work, not O(N²)). The exact rule is evaluated on the
candidates alone (in chunks of query blocks, so at most about 2^24 pairs at once): a candidate where no pair is
allowed is dropped, one where every pair is allowed is a *full* block (the kernel skips ``mask_mod`` there), the
rest are partial. Everything is tensor operations (the reach's width on the host, the tables and the rule on the
queries' device), with no Python loop per block or step, no device-to-host read and no host-to-device copy.
Static patterns (no data masks) are cached by their ``cache_key`` and sizes; data masks (padding, groups) are
built per call. Routing's and LSH's sorted windows build theirs from their intervals (``interval_block_mask``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

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
    if pattern.labels is not None and block[0] == block[1]:
        return _labelled(pattern, device, block)
    key = None
    if pattern.cache_key is not None and not pattern.per_head:
        key = (pattern.cache_key, pattern.nq, pattern.nk, str(device), block)
    return _cached(key, lambda: _build(pattern, batch if pattern.per_head else 1, heads if pattern.per_head else 1,
                                       device, block))


def _cached(key: tuple | None, make):
    """``make()``, kept under ``key`` among the last ``_CACHE_SIZE`` (None: made every time)."""
    if key is None:
        return make()
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    _CACHE[key] = made = make()
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return made


class _Candidates(NamedTuple):
    """A pattern's block tables before they are listed: ``cand`` (nqb, C) the key blocks each query block's reach
    covers, ``some`` and ``every`` (B, H, nqb, C) whether a candidate holds an allowed pair, and only those."""

    cand: Tensor
    some: Tensor
    every: Tensor


def _tables_of(pattern: FlexPattern, B: int, H: int, device: torch.device, block: tuple[int, int]) -> _Candidates:
    """The exact rule evaluated on every candidate pair of blocks, in chunks of query blocks."""
    bq, bk = block
    nq_blocks = -(-pattern.nq // bq)
    width = _candidates(pattern, bq, bk, torch.device("cpu"))[0].shape[1]  # C, read off host tensors
    # the tables on the device itself, from the same arithmetic: no copy from host memory (from pageable memory a
    # copy to CUDA may synchronise the stream)
    cand, in_reach = _candidates(pattern, bq, bk, device, width)

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
    return _Candidates(cand, some, every)


def _build(pattern: FlexPattern, B: int, H: int, device: torch.device, block: tuple[int, int]):
    """The ``BlockMask`` of ``pattern``'s rule evaluated on every candidate pair of blocks, for (B, H)."""
    return _mask(pattern, _tables_of(pattern, B, H, device, block), block)


def _mask(pattern: FlexPattern, tables: _Candidates, block: tuple[int, int]):
    from torch.nn.attention.flex_attention import BlockMask

    nk_blocks = -(-pattern.nk // block[1])
    kv_num, kv_idx = ordered_blocks(tables.some & ~tables.every, tables.cand, nk_blocks)
    full_num, full_idx = ordered_blocks(tables.every, tables.cand, nk_blocks)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=pattern.allowed, seq_lengths=(pattern.nq, pattern.nk))


def _labelled(pattern: FlexPattern, device: torch.device, block: tuple[int, int]):
    """The ``BlockMask`` of a pattern whose rule also wants a query's and a key's labels equal, labels that never
    decrease along the sequence (``FlexPattern.labels``: packed documents). The tables of the rule without them
    (``unlabelled``: one per sizes, cached as a static pattern's mask is) are narrowed by each block's first and last
    label: a pair of blocks whose label ranges are disjoint holds no allowed pair and is dropped; a full one stays
    full only where both blocks hold one and the same label; the rest are partial (``mask_mod``, the whole rule,
    decides within). A fixed number of operations on (B, nqb, C) integers, whatever N and however many documents:
    no pair of positions evaluated."""
    static = dataclasses.replace(pattern, allowed=pattern.unlabelled, per_head=False, labels=None, unlabelled=None)
    key = None if static.cache_key is None else ("tables", static.cache_key, static.nq, static.nk, str(device), block)
    tables = _cached(key, lambda: _tables_of(static, 1, 1, device, block))
    labels = pattern.labels  # (B, 1, N)
    n, size = labels.shape[-1], block[0]
    starts = torch.arange(0, n, size, device=labels.device)
    first = labels.index_select(-1, starts)  # (B, 1, nb): every block's first label, and its last
    last = labels.index_select(-1, (starts + size - 1).clamp_max(n - 1))
    key_first, key_last = first[..., tables.cand], last[..., tables.cand]  # (B, 1, nqb, C)
    query_first, query_last = first[..., None], last[..., None]
    overlap = (key_first <= query_last) & (query_first <= key_last)
    one = (query_first == query_last) & (key_first == key_last) & (query_first == key_first)  # implies overlap
    return _mask(pattern, _Candidates(tables.cand, tables.some & overlap, tables.every & one), block)


def _candidates(pattern: FlexPattern, bq: int, bk: int, device: torch.device,
                width: int | None = None) -> tuple[Tensor, Tensor]:
    """(cand, in_reach) (nqb, C) on ``device``: the key blocks each query block's reach covers (clamped to the last
    block) and whether each is within it. The reach is arithmetic on block numbers. ``width`` None: C is read off
    the result, which must then be on the host (a host read of a host tensor, never a wait for the device); C
    depends only on the pattern's reach and sizes (not on the data), so the block mask's shapes do too."""
    nq_blocks, nk_blocks = -(-pattern.nq // bq), -(-pattern.nk // bk)
    first = torch.arange(nq_blocks, device=device) * bq
    last = (first + bq - 1).clamp(max=pattern.nq - 1)
    lo, hi = pattern.reach(first, last)
    lo_block = lo.clamp(0, pattern.nk - 1) // bk  # (nqb,)
    hi_block = hi.clamp(0, pattern.nk - 1) // bk
    if width is None:
        width = int((hi_block - lo_block).max()) + 1  # candidates per query block
    cand = lo_block[:, None] + torch.arange(width, device=device)  # (nqb, C)
    return cand.clamp(max=nk_blocks - 1), cand <= hi_block[:, None]


def ordered_blocks(chosen: torch.Tensor, cand: torch.Tensor, nk_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (B, H, nqb), indices (B, H, nqb, nkb)) of the chosen candidate blocks, listed first in key order."""
    B, H, nqb, width = chosen.shape
    keyed = torch.where(chosen, cand.expand(B, H, nqb, width), nk_blocks)  # unchosen sort last
    idx = keyed.sort(-1).values.clamp(max=nk_blocks - 1)
    idx = torch.nn.functional.pad(idx, (0, nk_blocks - width))  # FlexAttention wants one column per key block
    return chosen.sum(-1).to(torch.int32), idx.to(torch.int32).contiguous()


def interval_block_mask(lo: Tensor, hi: Tensor, reach: tuple[int, int], mask_mod, *, diagonal: bool = True,
                        key_blocks_whole: Tensor | None = None, block: int = BLOCK):
    """The ``BlockMask`` of rows whose keys are one interval each, [lo_i, hi_i] (inclusive), both bounds
    non-decreasing in i (``SortedWindow.intervals``): lo, hi (B, H, N) (B or H may be 1), N queries and N keys;
    ``reach`` = (back, ahead): query block b's keys lie in key blocks b - back … b + ahead.

    Every table is C = back + 1 + ahead columns wide, kv-major (the forward) and q-major (the backward; key block c
    is seen by query blocks c - ahead … c + back), built here rather than transposed from an (nqb, nkb) table, by a
    fixed number of operations on (B, H, N / block, C) integers whatever N is (the geometry that depends on the
    sizes alone is made once per size and device, ``_block_grid``). Since the bounds never decrease (and every interval
    holds a key, and consecutive rows' intervals leave no whole block between them, as a window's never do), query
    block b touches key block c exactly when c's first key <= hi of b's last row and c's last key >= lo of b's
    first row (a block listed so may still hold no allowed pair where the rule also tests the keys' validity or
    leaves the diagonal out: ``mask_mod`` decides there), and holds every pair of it when lo of its last row <= c's
    first key and c's last key <= hi of its first row. A block is full only when whole (``block`` rows and keys),
    apart from the diagonal block when ``diagonal`` is False (the rule leaves out a row's own key there), and when
    ``key_blocks_whole`` (B, H, nkb) bool says every key of it passes the rule's other tests (key validity)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, H, N = lo.shape
    grid = _block_grid(N, block, reach, diagonal, lo.device)
    nb = grid.ends.shape[0] // 2
    lo_ends, hi_ends = lo.index_select(-1, grid.ends), hi.index_select(-1, grid.ends)  # (B, H, 2 nb): first rows, last
    kv = _tables(lo_ends[..., None], hi_ends[..., None], grid.kv, key_blocks_whole, nb)  # each query block's own
    q = _tables(lo_ends[..., grid.q.rows], hi_ends[..., grid.q.rows], grid.q, key_blocks_whole, nb)
    return BlockMask(seq_lengths=(N, N), kv_num_blocks=kv[0], kv_indices=kv[1], full_kv_num_blocks=kv[2],
                     full_kv_indices=kv[3], q_num_blocks=q[0], q_indices=q[1], full_q_num_blocks=q[2],
                     full_q_indices=q[3], BLOCK_SIZE=(block, block), mask_mod=mask_mod)


class _Pairs(NamedTuple):
    """An (nb, C) grid of (query block, key block) pairs and what the sizes alone say of them: ``rows`` (nb, C) the
    query block of each pair, as an index into the ends (B, H, 2 nb) of first rows then last rows, shifted by nb
    for the last; ``k0``, ``k1`` the key block's first and last key; ``inside`` both blocks exist; ``whole`` both
    hold ``block`` positions (and are not the diagonal where that is left out); ``kb`` the key block (clamped);
    ``listed`` the block a table lists for the pair, int32."""

    rows: Tensor
    k0: Tensor
    k1: Tensor
    inside: Tensor
    whole: Tensor
    kb: Tensor
    listed: Tensor


class _BlockGrid(NamedTuple):
    ends: Tensor  # (2 nb,): every query block's first row, then every last row
    kv: _Pairs
    q: _Pairs


_GRIDS: OrderedDict = OrderedDict()


def _block_grid(n: int, block: int, reach: tuple[int, int], diagonal: bool, device: torch.device) -> _BlockGrid:
    """The size-only geometry of ``interval_block_mask``, made once per (n, block, reach, diagonal, device) (the
    last 16 kept): no operation of its own at later calls."""
    key = (n, block, reach, diagonal, str(device))
    if key in _GRIDS:
        _GRIDS.move_to_end(key)
        return _GRIDS[key]
    nb = -(-n // block)
    back, ahead = reach
    blocks = torch.arange(nb, device=device)
    first, last = blocks * block, (blocks * block + block - 1).clamp(max=n - 1)
    columns = torch.arange(back + 1 + ahead, device=device)

    def pairs(qb: Tensor, kb: Tensor, listed: Tensor) -> _Pairs:
        qb, kb = torch.broadcast_tensors(qb, kb)
        inside = (qb >= 0) & (qb < nb) & (kb >= 0) & (kb < nb)
        qc, kc = qb.clamp(0, nb - 1), kb.clamp(0, nb - 1)
        k0, k1 = first[kc], last[kc]
        whole = (k1 - k0 + 1 == block) & (last[qc] - first[qc] + 1 == block)
        if not diagonal:
            whole = whole & (qc != kc)
        return _Pairs(torch.stack([qc, qc + nb]), k0, k1, inside, whole, kc, listed.expand_as(qb).to(torch.int32))

    rows = blocks[:, None]
    kb = rows - back + columns
    qb = rows - ahead + columns
    grid = _BlockGrid(torch.cat([first, last]), pairs(rows, kb, kb), pairs(qb, rows, qb))
    _GRIDS[key] = grid
    if len(_GRIDS) > 16:
        _GRIDS.popitem(last=False)
    return grid


def _tables(lo: Tensor, hi: Tensor, pairs: _Pairs, key_blocks_whole: Tensor | None,
            nb: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(partial count, partial indices, full count, full indices) of the pairs' grid, from the bounds ``lo``, ``hi``
    at every query block's first and last rows (B, H, 2 nb, 1) or, gathered for the pairs, (B, H, 2, nb, C)."""
    if lo.dim() == 4:  # (B, H, 2 nb, 1): one query block per row of the grid
        lo_first, lo_last, hi_first, hi_last = lo[:, :, :nb], lo[:, :, nb:], hi[:, :, :nb], hi[:, :, nb:]
    else:  # (B, H, 2, nb, C)
        lo_first, lo_last, hi_first, hi_last = lo[:, :, 0], lo[:, :, 1], hi[:, :, 0], hi[:, :, 1]
    some = pairs.inside & (pairs.k0 <= hi_last) & (pairs.k1 >= lo_first)  # (B, H, nb, C)
    full = some & pairs.whole & (lo_last <= pairs.k0) & (pairs.k1 <= hi_first)
    if key_blocks_whole is not None:
        full = full & key_blocks_whole[..., pairs.kb]
    return (*_compact(some & ~full, pairs.listed, nb), *_compact(full, pairs.listed, nb))


def _compact(chosen: Tensor, listed: Tensor, n_blocks: int) -> tuple[Tensor, Tensor]:
    """(count (B, H, nb) int32, indices (B, H, nb, C) int32 contiguous): the blocks ``listed`` (nb, C) int32,
    ascending along C, where ``chosen``, first and in order (after them: the last block, never read)."""
    keyed = torch.where(chosen, listed, n_blocks)  # unchosen sort last
    return chosen.sum(-1, dtype=torch.int32), keyed.sort(-1).values.clamp_max(n_blocks - 1)
