"""Attention of query entries to contiguous ranges of keys: the piece behind multi-probe routing.

Entry m asks with query row m // merge and attends to the keys [lo_m, hi_m) of one key sequence, at most ``width``
of them; the ``merge`` entries of a query row are one softmax over the union of their ranges (disjoint ranges: a
key counts once). The ranges are arbitrary (several entries may end at the same key, and many keys may end no
range), so no band fits. Instead the key sequence is cut into stretches of G keys, and every entry goes with the
stretch its last key lies in: its keys then lie in that stretch and the ``reach = ceil((width - 1) / G)`` before
it. The first R entries of every stretch form one tile of R rows against the span of reach + 1 stretches, a strided
view of the keys (no copy), and all tiles are one call of the executor's ``tiled`` with ``rows=R``. R is chosen
from the entries' spread (about the mean per stretch, a multiple of 8) so that few entries are left over; those
few each get a span of keys gathered for them (``_gathered``). The entries' results are merged straight out of the
tiles (``_Merge``), without laying them out in entry order first. Time and memory
O((N / G · R + leftover) · (width + G) · D).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .inputs import Inputs, RelTerms
from .lse import neg_inf, saw_key
from .relative import RelativePositions
from .rows import RowKernel, gather_rows, move_rows, rowdot
from .tiling import Distances, Tiling

Tiled = Callable[..., tuple[Tensor, Tensor | None]]  # an executor's checked ``tiled`` operation (``interface.py``)

LEFTOVER = 0.03  # R is the smallest multiple of 8 that leaves at most this share of the entries to the gathered pass
TILE_ROWS_PER_ENTRY = 2  # ... unless the tiles would then hold more rows than this many per entry


class Ranges(NamedTuple):
    """Every query entry's contiguous range of keys: entry m asks with query row m // ``merge`` and attends to the
    keys [lo_m, hi_m) of the key sequence (at most ``width`` of them); the ``merge`` entries of a row are one
    softmax (their ranges must not overlap: a key in two of them would count twice).

    lo, hi: (B, H, Nq · merge) long, 0 <= lo <= hi <= N. query_pos, key_pos: (B, H, Nq) and (B, H, N) (per row of
    k, before any ``KeyOrder``) long positions, needed with relative positions: distances are key_pos - query_pos.
    Each of them may give B or H as 1, standing for all (``broadcast_ranges``).
    stretch, rows: how the tiles cut them, G and R (defaults: ``range_stretch(width)``, and from the entries'
    spread; ``rows`` also fixes the gathered pass's block rows).
    documents: (B, Nq) long or None, the query rows' packed documents where the ranges already lie within them (the
    caller laid them so): an executor may cut its work where they change, and the fused and tiles ones do (the
    tiles one outside torch.compile, whose gathered pass has no host read to count the blocks with), so that one
    document's sums never depend on another's (bit for bit). Any ids: only where they change counts.
    """

    lo: Tensor
    hi: Tensor
    width: int
    merge: int = 1
    query_pos: Tensor | None = None
    key_pos: Tensor | None = None
    stretch: int | None = None
    rows: int | None = None
    documents: Tensor | None = None


class KeyOrder(NamedTuple):
    """The order the ranges index the keys in: ``order`` (B, H, N) a permutation (e.g. the keys sorted by
    cluster: the ranges index k[order]) and ``inverse`` its inverse (B or H of 1 standing for all)."""

    order: Tensor
    inverse: Tensor


def document_ranges(queries: Tensor, memory: Tensor) -> Ranges:
    """Packed documents across two sequences as ranges: query row i's entry is the whole of its document's run of
    the memory. ``queries`` (B, Nq) and ``memory`` (B, Nk) document ids numbered from 0 within each row, as many on
    both sides (``documents.check_cross_documents``). O(B · (Nq + Nk)), one read of the device (the widest
    document)."""
    counts = memory.new_zeros(memory.shape[0], int(memory[:, -1].max()) + 1).scatter_add_(
        1, memory, torch.ones_like(memory))  # (B, P): each memory document's length
    end = counts.cumsum(-1)
    lo, hi = (end - counts).gather(1, queries), end.gather(1, queries)  # (B, Nq)
    return Ranges(lo[:, None], hi[:, None], width=max(1, int(counts.max())), documents=queries)


def range_attention(tiled: Tiled, inputs: Inputs, spans: Ranges, *, order: KeyOrder | None = None,
                    rel_pos: RelativePositions | None = None, need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """Query row i attends to the keys lo_m <= j < hi_m of its entries m = i·merge … i·merge + merge - 1 (``spans``):
    softmax(q·kᵀ · scale + rel) over their union, in tiles of ``tiled`` (see the module's docstring).

    inputs: q (B, H, Nq, D), k, v (B, H, N, D), the scale and key validity per row of k; ``order``: the keys' order
    the ranges index (default: k as it is); ``rel_pos``: relative-position tables (distances from the spans'
    positions). The arguments are checked by the caller, ``Executor.ranges`` (``check_ranges``).

    Returns:
        out (B, H, Nq, D), zeros for a row that sees no key, and lse (B, H, Nq) in float32 or wider (``neg_inf``
        exactly for a row that sees no key) or None, as the executor's ``tiled`` returns them.
    """
    q, k, v, scale, key_valid = inputs.q, inputs.k, inputs.v, inputs.scale, inputs.key_valid
    lo, hi, width, merge, query_pos, key_pos, stretch, rows, documents = spans
    B, H, N, D = k.shape
    Nq, M = q.shape[2], lo.shape[-1]
    G = stretch or range_stretch(width)
    if order is not None:  # the keys in the order the ranges index: one copy, then every span is a view
        # q·k scaled once on that copy of the keys (free), unless relative terms q·a need the query scaled
        key_scale, scale = (scale, 1.0) if rel_pos is None else (1.0, scale)
        k = move_rows(k, order.order, order.inverse, unreached=False, scale=key_scale)
        v = move_rows(v, order.order, order.inverse, unreached=False)
        key_valid = None if key_valid is None else key_valid.expand(B, H, N).gather(-1, order.order)
        key_pos = None if key_pos is None else key_pos.gather(-1, order.order)
    if scale != 1.0:  # once, on the query rows (the executor is called with scale 1)
        q = q * scale
    compiling = torch.compiler.is_compiling()
    # with documents, no block of the gathered pass holds two documents' entries (not compiled: that needs a host read
    # of how many blocks there are)
    sides = _Sides(q, query_pos, lo, hi, merge, None if compiling else documents)
    keys = _Keys(k, v, key_valid, key_pos, rel_pos)
    every = torch.arange(M, device=k.device).expand(B, H, M)
    if compiling:  # no host read: every entry through the gathered pass, at its size bound
        parts = [_gathered(tiled, sides, keys, every, width=width, stretch=G, rows=rows, bound=True)]
    elif documents is not None:  # every entry through the gathered pass, in blocks of one document and of a size
        # that no entry sets: a document's sums are its own, bit for bit (the tiles' rows and ranks within a stretch
        # depend on every entry)
        parts = [_gathered(tiled, sides, keys, every, width=width, stretch=G, rows=rows)]
    else:
        parts = _tiles(tiled, sides, keys, width=width, stretch=G, rows=rows)
    return merge_parts(parts, merge, Nq, need_lse)


def check_ranges(q: Tensor, spans: Ranges, rel_pos: RelativePositions | None) -> None:
    """A ValueError when the entries do not fit the queries and ``merge``, or relative positions lack positions."""
    Nq, M = q.shape[2], spans.lo.shape[-1]
    if Nq * spans.merge != M:
        raise ValueError(f"lo and hi hold {M} entries; {Nq} queries with merge={spans.merge} need {Nq * spans.merge}")
    if rel_pos is not None and (spans.key_pos is None or spans.query_pos is None):
        raise ValueError("relative positions need query_pos and key_pos")
    docs = spans.documents
    if docs is not None and (docs.dim() != 2 or docs.shape[0] not in (1, q.shape[0]) or docs.shape[1] != Nq
                             or docs.dtype != torch.long or docs.device != q.device):
        raise ValueError(f"Ranges.documents must be (B, Nq) = {(q.shape[0], Nq)} long on {q.device} (B of 1 "
                         f"standing for all), got {tuple(docs.shape)} {docs.dtype} on {docs.device}")


def broadcast_ranges(inputs: Inputs, spans: Ranges, order: KeyOrder | None) -> tuple[Ranges, KeyOrder | None]:
    """The per-head values of the ranges (lo, hi, the positions, the key order) as (B, H, ·) views, a batch or
    head dimension of 1 standing for all (every executor then reads each head's own row); a ValueError naming the
    value that is not (B, H, n) or broadcast to it."""
    B, H, Nq, _ = inputs.q.shape
    N, M = inputs.k.shape[2], spans.lo.shape[-1]

    def per_head(x: Tensor | None, n: int, name: str, size: str) -> Tensor | None:
        if x is None:
            return None
        if x.dim() != 3 or x.shape[0] not in (1, B) or x.shape[1] not in (1, H) or x.shape[2] != n:
            raise ValueError(f"{name} must be (B, H, {size}) = {(B, H, n)} or broadcast to it (B or H of 1), got "
                             f"{tuple(x.shape)}")
        return x.expand(B, H, n)

    # Built whole, not by ``_replace``: dynamo 2.11 rebuilds a ``_replace``d NamedTuple empty after a graph break.
    spans = Ranges(per_head(spans.lo, M, "Ranges.lo", "M"), per_head(spans.hi, M, "Ranges.hi", "M"), spans.width,
                   spans.merge, per_head(spans.query_pos, Nq, "Ranges.query_pos", "Nq"),
                   per_head(spans.key_pos, N, "Ranges.key_pos", "N"), spans.stretch, spans.rows,
                   None if spans.documents is None else spans.documents.expand(B, Nq))
    if order is not None:
        order = KeyOrder(per_head(order.order, N, "KeyOrder.order", "N"),
                         per_head(order.inverse, N, "KeyOrder.inverse", "N"))
    return spans, order


class _Keys(NamedTuple):
    """The key side, in the order the ranges index: keys, values, validity and positions."""

    k: Tensor
    v: Tensor
    valid: Tensor | None
    pos: Tensor | None
    rel_pos: RelativePositions | None


class RangePart(NamedTuple):
    """The result of one pass over some entries, in its own layout of X slots: out (B, H, X, D), lse (B, H, X), and
    ``entry`` (B, H, X), the entry in each slot (M for an empty one)."""

    out: Tensor
    lse: Tensor
    entry: Tensor


class _Sides:
    """The query side of a set of entries: the (scaled) query rows, their positions, the ranges, ``merge``, and the
    query rows' documents (``Ranges.documents``) or None."""

    def __init__(self, q: Tensor, pos: Tensor | None, lo: Tensor, hi: Tensor, merge: int,
                 documents: Tensor | None = None) -> None:
        self.q, self.pos, self.lo, self.hi, self.merge, self.documents = q, pos, lo, hi, merge, documents

    def at(self, entry: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
        """(lo, hi, position) of the entries in slots ``entry`` (B, H, X), M for an empty slot (range empty)."""
        M = self.lo.shape[-1]
        filled = entry < M
        e = entry.clamp_max(M - 1)
        lo = torch.where(filled, self.lo.gather(-1, e), 0).view(shape)
        hi = torch.where(filled, self.hi.gather(-1, e), 0).view(shape)
        return lo, hi, None if self.pos is None else self.pos.gather(-1, e // self.merge).view(shape)

    def queries(self, entry: Tensor) -> Tensor:
        """The query rows of the entries in slots ``entry`` (B, H, X) -> (B, H, X, D) (an empty slot gets row 0; its
        range is empty)."""
        M = self.lo.shape[-1]
        return _GatherRows.apply(self.q, torch.where(entry < M, entry // self.merge, 0))


class _GatherRows(torch.autograd.Function):
    """out[..., j, :] = x[..., index[j], :] for rows picked any number of times; the gradient adds them back
    (index_add), with no intermediate (B, H, M, D) copy."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.shape = x.shape
        return gather_rows(x, index)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        B, H, N, D = ctx.shape
        flat = (index + torch.arange(B * H, device=index.device).view(B, H, 1) * N).reshape(-1)
        out = grad.new_zeros(B * H * N, D).index_add_(0, flat, grad.reshape(-1, D))
        return out.view(B, H, N, D), None


def _tiles(tiled: Tiled, sides: _Sides, keys: _Keys, *, width: int, stretch: int,
           rows: int | None) -> list[RangePart]:
    """The tiles of R rows per stretch, and the gathered pass for the entries left over."""
    k = keys.k
    B, H, N, D = k.shape
    M, G = sides.lo.shape[-1], stretch
    # Entries in order of hi; group g holds those whose last key lies in stretch g: hi in (g·G, (g + 1)·G].
    n_groups = -(-N // G)
    order = sides.hi.argsort(dim=-1, stable=True)  # (B, H, M)
    group = (sides.hi.gather(-1, order) - 1).clamp_min(0) // G
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
    # lo, hi lie in [0, N]: the mask also keeps every column outside the keys out, as ``rows`` requires
    mask = span_mask(first, last, key_index[:, :1, None], span.numel())
    delta = None
    if keys.rel_pos is not None:
        positions = keys.pos.gather(-1, key_index.clamp(0, N - 1).view(1, 1, -1).expand(B, H, -1))
        delta = positions.view(B, H, n_groups, 1, -1) - query_at
    out, lse = tiled(Inputs(sides.queries(entry), k, keys.v, 1.0, keys.valid),
                     Tiling(block=G, back=reach, rows=R, tile_mask=mask),
                     rel=None if delta is None else RelTerms(keys.rel_pos, Distances(delta=delta)), need_lse=True)
    parts = [RangePart(out, lse, entry)]
    left = int((~in_tile).sum(-1).max())
    if left:  # the leftover entries, each block of them with its own gathered span
        pick = torch.where(in_tile, M, order).sort(-1).values[..., :left]  # leftover entries first, then M
        parts.append(_gathered(tiled, sides, keys, pick, width=width, stretch=G, rows=rows))
    return parts


def _gathered(tiled: Tiled, sides: _Sides, keys: _Keys, pick: Tensor, *, width: int, stretch: int,
              rows: int | None, bound: bool = False) -> RangePart:
    """The entries ``pick`` (B, H, L) (M: none) in blocks of at most T rows whose hi lie in one stretch of G keys,
    each block one tile against its own gathered span of width + G - 1 keys (keys in the ranges' order).
    ``bound``: as many blocks as there can be (L / T + N / G), not as there are (no host read). With the query
    rows' documents (``sides.documents``) a block also holds one document's entries."""
    k, v = keys.k, keys.v
    B, H, N, D = k.shape
    M, L, dev, G = sides.lo.shape[-1], pick.shape[-1], k.device, stretch
    real = pick < M
    hi = torch.where(real, sides.hi.gather(-1, pick.clamp_max(M - 1)), N + 1)  # the picked entries' ends; none last
    T = rows or max(8, min(128, round(L * G / N)))
    S = width + G - 1
    order = hi.argsort(dim=-1, stable=True)
    stretch = (hi.gather(-1, order) - 1).clamp(0, N - 1) // G  # each entry's stretch, in order of hi
    group, n_groups = stretch, (N - 1) // G + 1  # a block's entries are of one group
    if sides.documents is not None:  # a group is a run of entries of one stretch and one document, in order of hi
        query = pick.clamp_max(M - 1).gather(-1, order) // sides.merge  # each entry's query row, in order of hi
        doc = sides.documents[:, None, :].expand(B, H, -1).gather(-1, query)
        change = (stretch[..., 1:] != stretch[..., :-1]) | (doc[..., 1:] != doc[..., :-1])
        group, n_groups = torch.cat([torch.zeros_like(stretch[..., :1]), change.long().cumsum(-1)], -1), L
    counts = torch.zeros(B, H, n_groups, dtype=torch.long, device=dev).scatter_add_(-1, group, torch.ones_like(group))
    rank = torch.arange(L, device=dev) - (counts.cumsum(-1) - counts).gather(-1, group)
    blocks = (counts + T - 1) // T
    block = (blocks.cumsum(-1) - blocks).gather(-1, group) + rank // T
    n_blocks = -(-L // T) + n_groups if bound else max(1, int(blocks.sum(-1).max()))
    slot = block * T + rank % T
    entry = torch.full((B, H, n_blocks * T), M, dtype=torch.long, device=dev).scatter_(-1, slot, pick.gather(-1, order))
    start = torch.zeros(B, H, n_blocks, dtype=torch.long, device=dev).scatter_(-1, block, stretch) * G + 1 - width
    key_at = start[..., None] + torch.arange(S, device=dev)  # (B, H, NB, S)
    key_index = key_at.clamp(0, N - 1).view(B, H, n_blocks * S)
    first, last, query_at = sides.at(entry, (B, H, n_blocks, T, 1))
    mask = span_mask(first, last, start[..., None, None], S)  # (B, H, NB, T, S)
    if keys.valid is not None:
        mask = mask & keys.valid.expand(B, H, N).gather(-1, key_index).view(B, H, n_blocks, 1, S)
    delta = None if keys.rel_pos is None else (keys.pos.gather(-1, key_index).view(B, H, n_blocks, 1, S) - query_at)
    kb, vb = gather_rows(k, key_index), gather_rows(v, key_index)
    heads = H * n_blocks
    out, lse = tiled(
        Inputs(sides.queries(entry).view(B, heads, T, D), kb.view(B, heads, S, D), vb.view(B, heads, S, D), 1.0),
        Tiling.dense(T, tile_mask=mask.view(B, heads, 1, T, S)), need_lse=True,
        rel=None if delta is None else RelTerms(keys.rel_pos, Distances(delta=delta.reshape(B, heads, 1, T, S))),
    )
    return RangePart(out.view(B, H, n_blocks * T, D), lse.view(B, H, n_blocks * T), entry)


def merge_parts(parts: list[RangePart], merge: int, rows: int, need_lse: bool,
                kernel: RowKernel | None = None) -> tuple[Tensor, Tensor | None]:
    """Each query row's ``merge`` entries, out of the parts' slots, as one softmax over their keys (``_Merge``);
    rows gathered by a backend's row ``kernel`` where it has one (``rows.gather_rows``)."""
    B, H, _, D = parts[0].out.shape
    M = rows * merge
    entry = torch.cat([p.entry for p in parts], -1) if len(parts) > 1 else parts[0].entry  # (B, H, X)
    # where each entry sits among the slots of the parts laid end to end (an entry is in exactly one slot)
    slots = torch.arange(entry.shape[-1], device=entry.device).expand_as(entry)
    source = torch.empty(B, H, M + 1, dtype=torch.long, device=entry.device).scatter_(-1, entry, slots)[..., :M]
    lse = torch.cat([p.lse for p in parts], -1) if len(parts) > 1 else parts[0].lse
    out, merged_lse = _Merge.apply(source.view(B, H, rows, merge), entry, lse, merge, kernel,
                                   *(p.out for p in parts))
    return out, merged_lse if need_lse else None


class _Merge(torch.autograd.Function):
    """Outputs of slots, merged per query row: o_i = Σ_t w_it o_{s(i,t)}, w_it = exp(l_{s(i,t)} - L_i),
    L_i = logsumexp_t l_{s(i,t)} (a slot whose row saw no key has weight 0 and leaves L_i alone).

    The slots' outputs come in several parts laid end to end (the tiles, the gathered pass); ``source`` (B, H, Nq,
    merge) is each entry's slot among them, ``entry`` (B, H, X) each slot's entry (M: none), ``lse`` (B, H, X) the
    slots' log-sum-exp. The gradient reaches the slots straight from the rows' (no (B, H, M, D) tensor in entry
    order): d o_s = w_s · d o_i and d l_s = w_s · (d o_i · o_s - d o_i · o_i + d L_i), with s = s(i, t).
    """

    @staticmethod
    def forward(ctx, source: Tensor, entry: Tensor, lse: Tensor, merge: int,  # type: ignore[override]
                kernel: RowKernel | None, *outs: Tensor):
        B, H, Nq, p = source.shape
        starts = [0]
        for o in outs:
            starts.append(starts[-1] + o.shape[2])
        slot_lse = lse.gather(-1, source.view(B, H, Nq * p)).view(B, H, Nq, p)
        seen = saw_key(slot_lse)
        floor = neg_inf(lse.dtype)
        slot_lse = torch.where(seen, slot_lse, floor)
        total = slot_lse.logsumexp(-1, keepdim=True)
        weight = torch.where(seen, (slot_lse - total).exp(), 0.0)  # (B, H, Nq, p)
        merged = None
        for t in range(p):
            part = _pick(outs, starts, source[..., t], kernel)
            merged = part * weight[..., t, None].to(part.dtype) if merged is None else merged.addcmul(
                part, weight[..., t, None].to(part.dtype))
        total = torch.where(seen.any(-1, keepdim=True), total, floor)[..., 0]
        ctx.save_for_backward(source, entry, weight, merged, *outs)
        ctx.merge, ctx.starts, ctx.kernel = merge, starts, kernel
        return merged, total

    @staticmethod
    def backward(ctx, grad: Tensor, grad_total: Tensor | None):  # type: ignore[override]
        source, entry, weight, merged, *outs = ctx.saved_tensors
        B, H, Nq, p = source.shape
        M = Nq * p
        X = entry.shape[-1]
        # Per slot: its weight and its query row (an empty slot: weight 0, row 0).
        slot_weight = weight.new_zeros(B, H, X + 1).scatter_(-1, source.view(B, H, M), weight.view(B, H, M))[..., :X]
        row = torch.where(entry < M, entry // ctx.merge, 0)
        along = rowdot(grad.to(weight.dtype), merged.to(weight.dtype))  # (B, H, Nq): d o_i · o_i
        if grad_total is not None:
            along = along - grad_total
        grad_outs, grad_lse = [], []
        for i, out in enumerate(outs):
            lo, hi = ctx.starts[i], ctx.starts[i + 1]
            w, r = slot_weight[..., lo:hi], row[..., lo:hi]
            g = gather_rows(grad, r, ctx.kernel).mul_(w[..., None].to(grad.dtype))  # (B, H, X_i, D)
            grad_outs.append(g)
            grad_lse.append(rowdot(g.to(w.dtype), out.to(w.dtype)) - w * along.gather(-1, r))
        lse_grad = torch.cat(grad_lse, -1) if len(grad_lse) > 1 else grad_lse[0]
        return (None, None, lse_grad, None, None, *grad_outs)


def _pick(outs: tuple[Tensor, ...], starts: list[int], index: Tensor, kernel: RowKernel | None) -> Tensor:
    """Rows ``index`` (B, H, Nq) of the parts ``outs`` laid end to end -> a fresh (B, H, Nq, D). A later part's
    rows (the gathered pass's leftovers) by a gather and a selection over every row, not by finding the few that
    are there: that would be a host read of a device tensor (a wait for the device on CUDA)."""
    first = outs[0].shape[2]
    rows = gather_rows(outs[0], index.clamp_max(first - 1), kernel)
    for i in range(1, len(outs)):
        where = (index >= starts[i]) & (index < starts[i + 1])
        later = gather_rows(outs[i], (index - starts[i]).clamp(0, outs[i].shape[2] - 1), kernel)
        rows = torch.where(where[..., None], later, rows)
    return rows


def span_mask(first: Tensor, last: Tensor, start: Tensor, width: int) -> Tensor:
    """The bool (..., width) mask of the columns start + c, 0 <= c < width, that lie in [first, last): first, last
    (..., 1) long, start broadcastable to them.

    Looked up rather than compared: a row's columns in [a, b) are ``_at_least(a) & _below(b)``, two rows of small
    (width + 1, width) tables, gathered (memcpy-like) instead of two broadcast comparisons of long tensors (about
    15 times faster on CPU at the routing tiles' sizes)."""
    a = (first - start).clamp(0, width)
    b = (last - start).clamp(0, width)
    shape = (*torch.broadcast_shapes(a.shape, b.shape)[:-1], width)
    at_least, below = _column_tables(width, first.device)
    mask = (at_least.index_select(0, a.expand(shape[:-1] + (1,)).reshape(-1))
            & below.index_select(0, b.expand(shape[:-1] + (1,)).reshape(-1)))
    return mask.view(torch.bool).view(shape)


@functools.lru_cache(maxsize=16)
def _column_tables(width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row a of the first table: columns c >= a; row b of the second: columns c < b; (width + 1, width) uint8 each
    (uint8, not bool: index_select copies uint8 rows several times faster)."""
    col = torch.arange(width, device=device)
    bound = torch.arange(width + 1, device=device)[:, None]
    return (col >= bound).to(torch.uint8), (col < bound).to(torch.uint8)


def _tile_rows(counts: Tensor, entries: int) -> int:
    """R: the smallest multiple of 8 that leaves at most ``LEFTOVER`` of the entries over (one host read), capped
    so that the tiles hold at most ``TILE_ROWS_PER_ENTRY`` rows per entry: every stretch gets R rows, so a few
    crowded stretches (many queries whose probed cluster ended in the same stretch of keys, or whose range is
    empty there) would otherwise make the tiles O(N · entries) (at N = 2048 a model step took 24 GB); what the cap
    leaves over goes through the gathered pass, O(entries · width)."""
    per_group = counts.flatten(0, 1).sort(-1, descending=True).values  # (B·H, ng)
    cap = max(8, 8 * (TILE_ROWS_PER_ENTRY * entries // (8 * per_group.shape[-1])))
    top = min(int(per_group.max()), cap)
    for R in range(8, top + 8, 8):
        if int((per_group - R).clamp_min(0).sum(-1).max()) <= LEFTOVER * entries:
            return R
    return max(8, top)


def range_stretch(width: int) -> int:
    """G, the keys per stretch: half the width (spans of 1.5 widths), at least 8."""
    return max(8, math.ceil(width / 2))
