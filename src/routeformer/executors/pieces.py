"""The pieces the patterns are built from, as values the executor's one operation takes:
``executor.tiled(inputs, piece, rel=..., need_lse=...)``.

A ``Tiling`` is the plain piece. The others say what they mean and lay the call out once, for every executor: the
tiling, and for ``Subset`` and ``Columns`` the gathered or grid inputs and the relative distances; ``Columns`` puts
the result back from the grid. Being values, they cost no call of their own between a mechanism and its kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .grid import columns_key_valid, from_columns, to_columns
from .inputs import Inputs, RelTerms
from .tiling import Distances, KeyRestrictions, Tiling, Window, shift_invariant_mask


class Laid(NamedTuple):
    """One piece's call as ``tiled`` computes it: the inputs (gathered, or the grid's), the tiling, the relative
    terms at the piece's distances and the key restrictions (the caller's, and the piece's own groups)."""

    inputs: Inputs
    tiling: Tiling
    rel: RelTerms | None
    restrict: KeyRestrictions | None = None


@dataclass(frozen=True, eq=False)
class Band:
    """Sliding window over the sequence order of q, k, v (or over q[order], k[order], v[order]: see
    ``Tiling.order``): causal i - window < j <= i, else |i - j| < window (``Tiling.band``). Time O(N · window · D),
    memory O(N · window)."""

    window: int
    causal: bool
    order: Tensor | None = None

    def lay(self, inputs: Inputs, rel: RelTerms | None, restrict: KeyRestrictions | None) -> Laid:
        tiling = Tiling.band(self.window, inputs.q.shape[2], self.causal)
        if self.order is not None:
            tiling = dataclasses.replace(tiling, order=self.order)
        return Laid(inputs, tiling, rel, restrict)


@dataclass(frozen=True)
class BlockDiagonal:
    """Attention within blocks of ``block`` positions (j <= i too when causal); block >= N is one dense tile. Time
    O(N · block · D), memory O(N · block)."""

    block: int
    causal: bool

    def lay(self, inputs: Inputs, rel: RelTerms | None, restrict: KeyRestrictions | None) -> Laid:
        size = min(self.block, inputs.q.shape[2])
        # causal as a window of the whole block (the offsets j - i <= 0), not a mask tensor: read by executors from
        # the tiling, with no host read of a device tensor (flex's relative value pass enumerates those offsets)
        tiling = Tiling(block=size, window=Window(size, causal=True)) if self.causal else Tiling(block=size)
        return Laid(inputs, tiling, rel, restrict)


@dataclass(frozen=True, eq=False)
class Subset:
    """Every query against the keys at positions ``key_idx`` (M,) only, under ``allow`` (N, M) (rows may be empty):
    one dense (N, M) tile of the gathered keys (key validity gathered alike), relative distances key_idx[m] - i.
    Time O(N · M · D), memory O(N · M)."""

    key_idx: Tensor
    allow: Tensor | None

    def lay(self, inputs: Inputs, rel: RelTerms | None, restrict: KeyRestrictions | None) -> Laid:
        q, idx = inputs.q, self.key_idx
        N = q.shape[2]
        if rel is not None:
            rel = rel.at(Distances(delta=idx[None, :] - torch.arange(N, device=q.device)[:, None]))
        return Laid(inputs.keys_at(idx), Tiling.dense(N, allow=self.allow), rel, restrict)


@dataclass(frozen=True)
class Columns:
    """Keys in the query's column of the (N / width, width) grid at least ``gap`` rows away (earlier when causal):
    the Sparse Transformer's strided heads, by the transpose trick (``grid.py``). Each column is one dense (R, R)
    tile, R = ceil(N / width); relative distances are width · (row difference). Time O(N · R · D), memory
    O(N · R)."""

    width: int
    causal: bool
    gap: int

    def lay(self, inputs: Inputs, rel: RelTerms | None, restrict: KeyRestrictions | None) -> Laid:
        q, width = inputs.q, self.width
        B, _, N, _ = q.shape
        r = torch.arange(-(-N // width), device=q.device)
        offset = r[None, :] - r[:, None]  # key row - query row
        if self.causal:
            allow: Tensor | None = offset <= -self.gap
        else:
            allow = offset.abs() >= self.gap if self.gap else None
        grid = Inputs(to_columns(q, width), to_columns(inputs.k, width), to_columns(inputs.v, width),  # (B·w, H, R, D)
                      inputs.scale, columns_key_valid(inputs.key_valid, B, N, width, q.device))
        return Laid(grid, Tiling.dense(r.shape[0], allow=allow), None if rel is None else rel.at(Distances(unit=width)),
                    restrict)

    def finish(self, inputs: Inputs, out: Tensor, lse: Tensor | None) -> tuple[Tensor, Tensor | None]:
        N = inputs.q.shape[2]
        return from_columns(out, self.width, N), None if lse is None else from_columns(lse, self.width, N)


@dataclass(frozen=True, eq=False)
class SortedWindow:
    """The band of ``window`` over a sequence sorted by (group, position), within each group: routing's clusters,
    LSH's buckets. The sequence is q[order], k[order], v[order]; ``grouped`` (B, H, N) is the group of each sorted
    entry, non-decreasing along it (``sort_by_cluster`` makes it so), so that every group is one run. Sorted entry s
    sees the sorted keys t of its own run with s - window < t <= s when causal, |s - t| < window else;
    ``own_key=False``: never t = s (LSH's rounds, whose merge gives a query its own key when it saw no other).

    Every executor can run it as the band with ``order`` and ``groups=grouped`` (``lay``). Read as ``intervals``,
    entry s's keys are the one interval [lo_s, hi_s] of sorted indices, both bounds non-decreasing in s: a block of
    queries then sees at most ``ceil((window - 1) / block)`` key blocks before its own (as many after when not
    causal), which lets an executor build its block tables that narrow, by a fixed number of operations whatever N
    is (the flex executor). Time O(N · window · D), memory O(N · window).
    """

    window: int
    causal: bool
    order: Tensor
    grouped: Tensor
    own_key: bool = True
    inverse: Tensor | None = None  # the inverse permutation of ``order`` where the caller has it (else made)

    def lay(self, inputs: Inputs, rel: RelTerms | None, restrict: KeyRestrictions | None) -> Laid:
        if restrict is not None and restrict.groups is not None:
            raise ValueError("a SortedWindow's groups are its own (grouped): pass no KeyRestrictions.groups")
        if not self.own_key and restrict is not None and restrict.exclude_self:
            raise ValueError("a SortedWindow without its own key (own_key=False) takes no exclude_self")
        band = Tiling.band(self.window, inputs.q.shape[2], self.causal)
        if self.own_key:
            tiling = band
        elif self.causal and self.window > 1:  # the band's offsets stop before the own key
            tiling = Tiling(block=band.block, back=band.back, offsets=(band.offsets[0], -1))
        else:
            lo, hi = band.offsets
            tiling = Tiling(block=band.block, back=band.back, ahead=band.ahead, allow=shift_invariant_mask(
                band.block, band.back, band.ahead, lambda d: (d >= lo) & (d <= hi) & (d != 0),
                device=inputs.q.device))
        tiling = dataclasses.replace(tiling, order=self.order)
        restrict = KeyRestrictions(groups=self.grouped) if restrict is None else restrict._replace(groups=self.grouped)
        return Laid(inputs, tiling, rel, restrict)

    def intervals(self, own_when_alone: bool = False) -> tuple[Tensor, Tensor]:
        """(lo, hi), each shaped as ``grouped``: sorted entry s sees the sorted keys lo_s <= t <= hi_s (inclusive),
        both non-decreasing in s; causal without its own key (``own_key=False``) hi_s = s - 1, an interval that may
        be empty (two-sided: the own key lies inside, for the caller's rule to leave out). ``own_when_alone``
        (causal only): without the entry's own key where an earlier one is in its window, hi_s = s - 1 there (shared
        QK with every key real: a query sees its own key only when alone). A fixed number of operations on
        (B, H, N) integers, whatever N is."""
        g = self.grouped.contiguous()
        n = g.shape[-1]
        s = torch.arange(n, device=g.device)
        # the first entry of s's run: a binary search of the non-decreasing groups (a scan, cummax, took 178 µs at
        # 8 x 65,536 on an H200; the search is one independent lookup per entry)
        lo = torch.searchsorted(g, g).clamp_min(s - self.window + 1)
        if self.causal:
            if not self.own_key:
                return lo, (s - 1).expand_as(g)
            return (lo, s - (lo < s).long()) if own_when_alone else (lo, s.expand_as(g))
        if own_when_alone:
            raise ValueError("SortedWindow.intervals(own_when_alone=True) is causal only: leaving the own key out "
                             "of a two-sided window splits its interval")
        last = torch.searchsorted(g, g, right=True) - 1  # the last entry of s's run
        return lo, last.clamp_max(s + self.window - 1)


Piece = Tiling | Band | BlockDiagonal | Subset | Columns | SortedWindow


def lay(piece: Piece, inputs: Inputs, rel: RelTerms | None, restrict: KeyRestrictions | None) -> Laid:
    """``piece``'s call: a tiling as it is, any other piece laid out by itself; the inputs' documents (packed rows)
    turned into what every executor reads (``within_documents``), the laid inputs without them."""
    documents = inputs.documents
    if documents is not None:
        inputs = inputs.with_(documents=None)
        if isinstance(piece, SortedWindow):  # its own groups: the caller folds them (``documents_folded``)
            raise ValueError("a SortedWindow with documents: fold them into its groups first (documents_folded)")
    laid = Laid(inputs, piece, rel, restrict) if isinstance(piece, Tiling) else piece.lay(inputs, rel, restrict)
    return laid if documents is None else within_documents(piece, laid, documents)


def documents_in(tiling: Tiling, documents: Tensor) -> Tensor:
    """The documents (B, N) as per-entry labels in the tiling's sequence order: (B, 1, N), or (B, H, N) gathered
    by ``Tiling.order``."""
    doc = documents[:, None, :]
    if tiling.order is None:
        return doc
    order = tiling.order.to(torch.long)
    shape = torch.broadcast_shapes(doc.shape, order.shape)
    return doc.expand(shape).gather(-1, order.expand(shape))


def with_group(restrict: KeyRestrictions | None, labels: Tensor, n: int, *, ascending: bool) -> KeyRestrictions:
    """``restrict`` with ``labels`` (each in [0, n)) joined to its groups: two entries share the new group when they
    share both (group · n + label). ``ascending``: the labels never decrease along the sequence; the joined groups
    then do where the old ones did too (``KeyRestrictions.sorted_groups``)."""
    if restrict is None:
        return KeyRestrictions(groups=labels, sorted_groups=ascending)
    if restrict.groups is None:
        return restrict._replace(groups=labels, sorted_groups=ascending)
    return restrict._replace(groups=restrict.groups.to(torch.long) * n + labels,
                             sorted_groups=ascending and restrict.sorted_groups)


def within_documents(piece: Piece, laid: Laid, documents: Tensor) -> Laid:
    """A laid-out call that attends only within each position's document (``Inputs.documents``, (B, N) numbered
    from 0 in each row): the documents as key groups of a self-attention tiling (in its order), the grid's
    columns' documents for ``Columns``, a tile mask for ``Subset``'s gathered keys. Costs one label read per pair
    in the kernels, no (N, N) mask."""
    inputs, tiling = laid.inputs, laid.tiling
    nq, nk = inputs.q.shape[2], inputs.k.shape[2]
    if isinstance(piece, Subset):
        same = documents[:, :, None] == documents[:, piece.key_idx][:, None, :]  # (B, N, M)
        mask = same[:, None, None]  # (B, 1, 1, N, M): one tile
        mask = mask if tiling.tile_mask is None else tiling.tile_mask & mask
        return laid._replace(tiling=dataclasses.replace(tiling, tile_mask=mask))
    if isinstance(piece, Columns):
        grid = to_columns(documents[:, None, :, None], piece.width)[..., 0]  # (B · width, 1, R)
        # a column's positions c, c + width, … increase, so its documents never decrease (but for the zeros that
        # pad N to whole rows)
        n = documents.shape[-1]
        return laid._replace(restrict=with_group(laid.restrict, grid, n, ascending=n % piece.width == 0))
    if tiling.rows is not None or nq != nk:
        raise ValueError(f"documents need self-attention (as many keys as queries, no rows): got {nq} queries and "
                         f"{nk} keys")
    return laid._replace(restrict=with_group(laid.restrict, documents_in(tiling, documents), nk,
                                             ascending=tiling.order is None))


def documents_folded(piece: SortedWindow, documents: Tensor) -> SortedWindow:
    """A ``SortedWindow`` whose groups also part documents: group · N + document of every sorted entry. Still
    non-decreasing along the sorted sequence (within a group the entries are in position order, along which the
    documents never decrease), so its ``intervals`` stay one run per (group, document): a routing cluster's window
    never spends its slots on another document's keys."""
    n = documents.shape[-1]
    order = piece.order.to(torch.long)
    shape = torch.broadcast_shapes((documents.shape[0], 1, n), order.shape, piece.grouped.shape)
    doc = documents[:, None, :].expand(shape).gather(-1, order.expand(shape))
    return dataclasses.replace(piece, grouped=piece.grouped.to(torch.long).expand(shape) * n + doc)


def finish(piece: Piece, inputs: Inputs, out: Tensor, lse: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The result of ``piece``'s call on ``inputs`` in their own layout (``Columns``: back from the grid)."""
    return piece.finish(inputs, out, lse) if isinstance(piece, Columns) else (out, lse)
