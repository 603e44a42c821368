"""Attention of every query to a contiguous range of keys: the piece behind multi-probe routing.

Query entry m attends to the keys [lo_m, hi_m) of one key sequence, at most ``width`` of them. The ranges are
arbitrary (several entries may end at the same key, and many keys may end no range), so no band fits. Instead the
key sequence is cut into stretches of G keys, and every entry goes with the stretch its last key lies in: its keys
then lie in that stretch and the ``reach = ceil((width - 1) / G)`` before it. The first R entries of every stretch
form one tile of R rows against the span of reach + 1 stretches, a strided view of the keys (no copy), and all
tiles are one call of the executor's ``tiled`` with ``rows=R``. R is chosen from the entries' spread (about the
mean per stretch, a multiple of 8) so that few entries are left over; those few each get a span of keys gathered
for them (``_gathered``). Time and memory O((N / G · R + leftover) · (width + G) · D).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .relative import RelativePositions
from .rows import gather_rows, move_rows

if TYPE_CHECKING:  # pragma: no cover
    from .executors import Executor

LEFTOVER = 0.03  # R is the smallest multiple of 8 that leaves at most this share of the entries to the gathered pass


def range_attention(executor: Executor, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, *, width: int,
                    scale: float, key_order: Tensor | None = None, key_inverse: Tensor | None = None,
                    key_valid: Tensor | None = None, query_pos: Tensor | None = None, key_pos: Tensor | None = None,
                    rel_pos: RelativePositions | None = None, need_lse: bool = False, stretch: int | None = None,
                    rows: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Entry m attends to keys lo_m <= j < hi_m of k, v; softmax(q·kᵀ · scale + rel) over them.

    Args:
        q: (B, H, M, D) the entries' queries.
        k, v: (B, H, N, D) keys and values; the ranges index the sequence k[key_order] (``key_order`` (B, H, N) a
            permutation, e.g. the keys sorted by cluster, and ``key_inverse`` its inverse; default: k as it is).
        lo, hi: (B, H, M) long with 0 <= lo <= hi <= N and hi - lo <= ``width``.
        key_valid: optional bool (B, 1 or H, N) per row of k, False removes the key (padding).
        query_pos, key_pos: (B, H, M) and (B, H, N) (per row of k) long positions, needed with ``rel_pos``:
            relative distances are key_pos - query_pos.
        stretch, rows: G and R (defaults: ``range_stretch(width)``, and from the entries' spread; ``rows`` also
            fixes the gathered pass's block rows).

    Returns:
        out (B, H, M, D), zeros for an entry that sees no key, and lse (B, H, M) in float32 or wider
        (``neg_inf`` exactly for an entry that sees no key) or None, as the executor's operations return them.
    """
    B, H, N, D = k.shape
    M = lo.shape[-1]
    if rel_pos is not None and (key_pos is None or query_pos is None):
        raise ValueError("relative positions need query_pos and key_pos")
    G = stretch or range_stretch(width)
    if key_order is not None:  # the keys in the order the ranges index: one copy, then every span is a view
        k, v = (move_rows(x, key_order, key_inverse, unreached=False) for x in (k, v))
        key_valid = None if key_valid is None else key_valid.expand(B, H, N).gather(-1, key_order)
        key_pos = None if key_pos is None else key_pos.gather(-1, key_order)
    if scale != 1.0:  # once, before the entries are laid out (the executor is called with scale 1)
        q = q * scale
    sides = _Sides(q, query_pos, lo, hi)
    if torch.compiler.is_compiling():  # no host read: every entry through the gathered pass, at its size bound
        return _gathered(executor, sides, k, v, width=width, stretch=G, rows=rows, key_valid=key_valid,
                         key_pos=key_pos, rel_pos=rel_pos, need_lse=need_lse, bound=True)

    # Entries in order of hi; group g holds those whose last key lies in stretch g: hi in (g·G, (g + 1)·G].
    n_groups = -(-N // G)
    order = hi.argsort(dim=-1, stable=True)  # (B, H, M)
    group = (hi.gather(-1, order) - 1).clamp_min(0) // G
    counts = torch.zeros(B, H, n_groups, dtype=torch.long, device=k.device).scatter_add_(-1, group,
                                                                                       torch.ones_like(group))
    rank = torch.arange(M, device=k.device) - (counts.cumsum(-1) - counts).gather(-1, group)
    R = rows or _tile_rows(counts, M)
    in_tile = rank < R
    # The tiles: slot g·R + r holds group g's entry of rank r (a last, dump slot takes the leftover entries).
    dump = n_groups * R
    slot = torch.where(in_tile, group * R + rank, dump)
    entry = torch.full((B, H, dump + 1), M, dtype=torch.long, device=k.device).scatter_(-1, slot, order)[..., :dump]
    reach = math.ceil((width - 1) / G)
    span = torch.arange((reach + 1) * G, device=k.device)
    key_index = (torch.arange(n_groups, device=k.device)[:, None] - reach) * G + span  # (ng, S): key of each column
    first, last, query_at = sides.at(entry, (B, H, n_groups, R, 1))
    mask = (key_index[:, None, :] >= first) & (key_index[:, None, :] < last)  # lo, hi in [0, N]: keys in range
    delta = None
    if rel_pos is not None:
        positions = key_pos.gather(-1, key_index.clamp(0, N - 1).view(1, 1, -1).expand(B, H, -1))
        delta = positions.view(B, H, n_groups, 1, -1) - query_at
    where = torch.empty_like(slot).scatter_(-1, order, slot)  # entry m -> its slot, or the dump: left over
    out, lse = executor.tiled(sides.queries(entry, where), k, v, block=G, back=reach, rows=R, tile_mask=mask,
                              scale=1.0, key_valid=key_valid, rel_pos=rel_pos, rel_delta=delta, empty_rows=True,
                              need_lse=need_lse)
    left = int((~in_tile).sum(-1).max())
    if left:  # the leftover entries, each block of them with its own gathered span
        pick = torch.where(in_tile, M, order).sort(-1).values[..., :left]  # leftover entries first, then M
        number = torch.full((B, H, M + 1), left, dtype=torch.long, device=k.device).scatter_(
            -1, pick, torch.arange(left, device=k.device).expand(B, H, left))[..., :M]  # entry -> its place, or left
        sub = sides.subset(pick, number)
        more, more_lse = _gathered(executor, sub, k, v, width=width, stretch=G, rows=rows, key_valid=key_valid,
                                   key_pos=key_pos, rel_pos=rel_pos, need_lse=need_lse)
        where = torch.where(where == dump, dump + number, where)
        entry = torch.cat([entry, torch.where(pick < M, pick, M)], dim=-1)
        out = torch.cat([out, more], dim=2)
        lse = None if lse is None else torch.cat([lse, more_lse], dim=2)
    out = move_rows(out, where, entry)
    return out, None if lse is None else lse.gather(-1, where)


class _Sides:
    """The query side of a set of entries: their (scaled) queries, positions and ranges."""

    def __init__(self, q: Tensor, pos: Tensor | None, lo: Tensor, hi: Tensor) -> None:
        self.q, self.pos, self.lo, self.hi = q, pos, lo, hi

    def at(self, entry: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
        """(lo, hi, position) of the entries in slots ``entry`` (B, H, X), M for an empty slot (range empty)."""
        M = self.lo.shape[-1]
        filled = entry < M
        e = entry.clamp_max(M - 1)
        lo = torch.where(filled, self.lo.gather(-1, e), 0).view(shape)
        hi = torch.where(filled, self.hi.gather(-1, e), 0).view(shape)
        return lo, hi, None if self.pos is None else self.pos.gather(-1, e).view(shape)

    def queries(self, entry: Tensor, where: Tensor) -> Tensor:
        """The queries laid out in slots: ``entry`` (B, H, X) the entry of each slot (M: empty, its query masked
        anyway), ``where`` (B, H, M) each entry's slot -> (B, H, X, D)."""
        return move_rows(self.q, entry, where)

    def subset(self, pick: Tensor, number: Tensor) -> _Sides:
        """The entries ``pick`` (B, H, L) (M: none; their ranges are empty), ``number`` (B, H, M) each entry's
        place in ``pick`` (L where it has none)."""
        M = self.lo.shape[-1]
        real, e = pick < M, pick.clamp_max(M - 1)
        return _Sides(move_rows(self.q, pick, number), None if self.pos is None else self.pos.gather(-1, e),
                      torch.where(real, self.lo.gather(-1, e), 0), torch.where(real, self.hi.gather(-1, e), 0))


def _gathered(executor: Executor, sides: _Sides, k: Tensor, v: Tensor, *, width: int, stretch: int,
              rows: int | None, key_valid: Tensor | None, key_pos: Tensor | None, rel_pos: RelativePositions | None,
              need_lse: bool, bound: bool = False) -> tuple[Tensor, Tensor | None]:
    """Entries in blocks of at most T rows whose hi lie in one stretch of G keys, each block one tile against its own
    gathered span of width + G - 1 keys (keys in the ranges' order). ``bound``: as many blocks as there can be
    (M / T + N / G), not as there are (no host read)."""
    B, H, N, D = k.shape
    lo, hi = sides.lo, sides.hi
    M = lo.shape[-1]
    dev = k.device
    G = stretch
    T = rows or max(8, min(128, round(M * G / N)))
    S = width + G - 1
    order = hi.argsort(dim=-1, stable=True)
    group = (hi.gather(-1, order) - 1).clamp_min(0) // G
    n_groups = (N - 1) // G + 1
    counts = torch.zeros(B, H, n_groups, dtype=torch.long, device=dev).scatter_add_(-1, group, torch.ones_like(group))
    rank = torch.arange(M, device=dev) - (counts.cumsum(-1) - counts).gather(-1, group)
    blocks = (counts + T - 1) // T
    block = (blocks.cumsum(-1) - blocks).gather(-1, group) + rank // T
    n_blocks = -(-M // T) + n_groups if bound else max(1, int(blocks.sum(-1).max()))
    slot = block * T + rank % T
    entry = torch.full((B, H, n_blocks * T), M, dtype=torch.long, device=dev).scatter_(-1, slot, order)
    where = torch.empty_like(slot).scatter_(-1, order, slot)  # entry m -> its slot
    start = torch.zeros(B, H, n_blocks, dtype=torch.long, device=dev).scatter_(-1, block, group) * G + 1 - width
    keys = start[..., None] + torch.arange(S, device=dev)  # (B, H, NB, S)
    key_index = keys.clamp(0, N - 1).view(B, H, n_blocks * S)
    first, last, query_at = sides.at(entry, (B, H, n_blocks, T, 1))
    keys = keys[:, :, :, None, :]
    mask = (keys >= first) & (keys < last)
    if key_valid is not None:
        mask = mask & key_valid.expand(B, H, N).gather(-1, key_index).view(B, H, n_blocks, 1, S)
    delta = None if rel_pos is None else key_pos.gather(-1, key_index).view(B, H, n_blocks, 1, S) - query_at
    kb, vb = gather_rows(k, key_index), gather_rows(v, key_index)
    heads = H * n_blocks
    out, lse = executor.tiled(
        sides.queries(entry, where).view(B, heads, T, D), kb.view(B, heads, S, D), vb.view(B, heads, S, D), block=T,
        tile_mask=mask.view(B, heads, 1, T, S), scale=1.0, rel_pos=rel_pos,
        rel_delta=None if delta is None else delta.reshape(B, heads, 1, T, S), empty_rows=True, need_lse=need_lse,
    )
    out = move_rows(out.view(B, H, n_blocks * T, D), where, entry)
    return out, None if lse is None else lse.view(B, H, n_blocks * T).gather(-1, where)


def _tile_rows(counts: Tensor, entries: int) -> int:
    """R: the smallest multiple of 8 that leaves at most ``LEFTOVER`` of the entries over (one host read)."""
    per_group = counts.flatten(0, 1).sort(-1, descending=True).values  # (B·H, ng)
    top = int(per_group.max())
    for R in range(8, top + 8, 8):
        if int((per_group - R).clamp_min(0).sum(-1).max()) <= LEFTOVER * entries:
            return R
    return max(8, top)


def range_stretch(width: int) -> int:
    """G, the keys per stretch: half the width (spans of 1.5 widths), at least 8."""
    return max(8, math.ceil(width / 2))
