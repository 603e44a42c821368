"""The values an attention executor takes: which keys each query may see (``Tiling``), how far apart a query and a
key are for relative positions (``Distances``), and the labels that narrow a self-attention's keys
(``KeyRestrictions``).

A *tiling* cuts the queries into blocks of T rows; query block b sees the keys of blocks b - back … b + ahead, a
*span* of S = (back + 1 + ahead) · block keys, under one (T, S) mask that is the same for every block (``allow``,
or the key-minus-query index range ``offsets`` of a sliding window), and optionally a mask that differs between
tiles (``tile_mask``). A single tile (``Tiling.dense``) holds every key. The geometry (which key index span column
s of block b is, which tile holds a pair) is written here once, for every executor.

Every executor computes softmax(q·kᵀ · scale + rel + bias, masked) · v over the tiles; ``executors.Executor.tiled``
checks these values against the inputs before it hands them on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True, eq=False)
class FeatureKernel:
    """A feature map an executor's scan may compute in kernels of its own (``Executor.scan_run``): φ(x) = elu(x) + 1
    (``projection`` None), or Performer's positive random features of ``projection`` (H, m, D) at the scale
    ``scale``, with the leak-free shifts of ``attention/performer.py`` (no gradient for the projection)."""

    projection: Tensor | None = None
    scale: float = 1.0


class HashRounds(NamedTuple):
    """LSH's rounds, for an executor that runs them all at once (``Executor.rounds_run``), each (B, H, R, N): every
    round's positions in sorted (bucket, position) order, the bucket of each sorted entry, and every position's
    label (bucket · (N + window) + sorted index: two positions share a round's window when their labels there differ
    by less than the window)."""

    order: Tensor
    groups: Tensor
    labels: Tensor


class KeyRestrictions(NamedTuple):
    """Per-entry labels of a self-attention sequence (as many keys as queries) that narrow what the tiling allows.
    Routing's band over its cluster-sorted sequence uses them; so may any self-attention over a reordered or
    segmented sequence. Given in the tiling's sequence order (``Tiling.order``).

    groups: optional integer (B, H, N) (a batch or head dimension of 1 stands for all): a query sees only keys of
        its own group.
    exclude_self: a query does not see the key at its own index unless no other key is allowed (shared-QK
        attention, where q_i·k_i would dominate).
    labels: optional integer (B, H, L, N): a pair whose labels differ by less than ``label_window`` in any of the L
        rows is left out (held by another call: LSH's earlier hash rounds, whose sorted windows already hold it).
    label_window: see ``labels``.
    sorted_groups: the groups never decrease along the sequence (packed documents in position order, or in a grid's
        columns): an executor may bound a block of entries' groups by its first and last entry's (the flex
        executor's block tables for documents, ``flex.blocks``).
    """

    groups: Tensor | None = None
    exclude_self: bool = False
    labels: Tensor | None = None
    label_window: int = 0
    sorted_groups: bool = False


@dataclass(frozen=True, eq=False)
class Distances:
    """The relative distance (key - query) of every pair, for relative positions: exactly one of

    unit: ``unit`` · (key index - query index): shift-invariant tiles, the fastest form.
    delta: an integer tensor broadcastable to (B, H, n_blocks, T, S), one distance per tile entry (irregular
        distances: summary cells, global tokens, gathered keys).
    positions: integer (B, H, N) (B or H may be 1), the original position of every entry of a sequence given in a
        permuted order (self-attention only): distance = positions[key] - positions[query].
    """

    unit: int | None = None
    delta: Tensor | None = None
    positions: Tensor | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("unit", "delta", "positions") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"Distances takes exactly one of unit, delta and positions, got "
                             f"{', '.join(given) if given else 'none'}")
        if self.unit is not None and (isinstance(self.unit, bool) or not isinstance(self.unit, int)
                                      or self.unit < 1):
            raise ValueError(f"Distances.unit must be a positive integer, got {self.unit!r}")
        for name in ("delta", "positions"):
            x = getattr(self, name)
            if x is not None and (not isinstance(x, Tensor) or x.is_floating_point() or x.dtype == torch.bool):
                raise ValueError(f"Distances.{name} must be an integer tensor, got "
                                 f"{getattr(x, 'dtype', type(x).__name__)}")


INDEX = Distances(unit=1)  # the distance of a pair is its key index - query index


@dataclass(frozen=True)
class Window:
    """A sliding window of ``window`` keys (``LocalOptions.window``, under that name down to the fused kernel's
    ``BandGeometry.window``): causal i - window < j <= i, else |i - j| < window. As key - query index offsets,
    (1 - window, 0) causal, (1 - window, window - 1) not: what a ``Tiling`` with this window carries as ``offsets``
    for the executors that read offsets (tiles, flex); the fused kernel derives them from the window itself."""

    window: int
    causal: bool

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"Window.window must be an integer >= 1, got {self.window!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"Window.causal must be a bool, got {self.causal!r}")

    @property
    def offsets(self) -> tuple[int, int]:
        return 1 - self.window, 0 if self.causal else self.window - 1


@dataclass(frozen=True, eq=False)
class Tiling:
    """Which keys each block of queries sees.

    block: keys per key block (and query rows per block unless ``rows``).
    back, ahead: neighbouring key blocks each query block sees. back = ahead = 0 with block >= the number of
        queries is one tile of every key (``dense``), where the keys may outnumber the queries.
    allow: static (T, S) bool mask, True = may attend; span column s of query block b is key index
        (b - back) · block + s (in a single tile, column s is key s).
    offsets: (lo, hi): instead of ``allow``, a pair may attend when lo <= key index - query index <= hi (a
        sliding window; executors may use it to compute relative terms on the strip of the tile it covers).
    window: the sliding window (``Window``) whose offsets these are, where they are one: given alone, it sets
        ``offsets``; the fused kernel takes the window itself (and derives the offsets).
    tile_mask: optional bool broadcastable to (B, H, n_blocks, T, S), ANDed with the static mask: a mask that
        differs between tiles.
    order: optional integer (B, H, N) permutation (B or H may be 1: the same for every batch entry or head;
        self-attention, no ``rows``): the tiling runs over the sequence
        q[order], k[order], v[order] (e.g. sorted by cluster), and the results come back in the original order of q.
        Per-position values of the call (key validity, ``KeyRestrictions``, ``Distances.positions``) are given in
        the tiling's order. An executor may read rows by index instead of copying the permuted sequence.
    rows: query rows per block when the queries are not the keys' own positions: q then holds exactly
        n_blocks · rows queries (n_blocks = ceil(Nk / block)), block b's against key blocks b - back … b + ahead
        (a layout the caller chose, e.g. the queries whose keys end in each key block). Then ``tile_mask`` is
        required and must keep out every span column beyond the keys; key restrictions, ``offsets`` and unit
        distances, which read query positions, do not apply; and a row the mask leaves without a key is not
        zeroed: its lse lies below ``neg_inf(lse.dtype) / 2`` (``saw_key`` is False) and its output is finite and
        meaningless, for the caller to discard (as ``ranges`` does).
    """

    block: int
    back: int = 0
    ahead: int = 0
    allow: Tensor | None = None
    offsets: tuple[int, int] | None = None
    tile_mask: Tensor | None = None
    rows: int | None = None
    order: Tensor | None = None
    window: Window | None = None

    def __post_init__(self) -> None:
        if self.window is not None:
            if not isinstance(self.window, Window):
                raise ValueError(f"Tiling.window must be a Window, got {type(self.window).__name__}")
            if self.offsets is None:
                object.__setattr__(self, "offsets", self.window.offsets)
            elif tuple(self.offsets) != self.window.offsets:
                raise ValueError(f"Tiling.offsets {self.offsets!r} are not those of its window {self.window!r} "
                                 f"({self.window.offsets!r})")
        for name in ("block", "back", "ahead", "rows"):
            x = getattr(self, name)
            low = 1 if name in ("block", "rows") else 0
            if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < low):
                raise ValueError(f"Tiling.{name} must be an integer >= {low}, got {x!r}")
        if self.allow is not None and self.offsets is not None:
            raise ValueError("a tiling takes allow or offsets, not both")
        if self.offsets is not None and (len(self.offsets) != 2 or self.offsets[0] > self.offsets[1]):
            raise ValueError(f"Tiling.offsets must be (lo, hi) with lo <= hi, got {self.offsets!r}")
        for name in ("allow", "tile_mask"):
            x = getattr(self, name)
            if x is not None and (not isinstance(x, Tensor) or x.dtype != torch.bool):
                raise ValueError(f"Tiling.{name} must be a bool tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if self.order is not None and (not isinstance(self.order, Tensor) or self.order.is_floating_point()
                                       or self.order.dtype == torch.bool or self.order.dim() != 3):
            raise ValueError(f"Tiling.order must be an integer (B, H, N) tensor, got "
                             f"{getattr(self.order, 'dtype', type(self.order).__name__)}")
        if self.order is not None and self.rows is not None:
            raise ValueError("Tiling.order and rows do not go together: with rows the queries are not the keys' own "
                             "positions")

    # --- constructors -------------------------------------------------------------------------------------------
    @staticmethod
    def dense(n: int, *, allow: Tensor | None = None, tile_mask: Tensor | None = None) -> Tiling:
        """One tile of every key for ``n`` queries: ``allow`` (n, Nk), ``tile_mask`` broadcastable to
        (B, H, 1, n, Nk)."""
        return Tiling(block=max(1, n), allow=allow, tile_mask=tile_mask)

    @staticmethod
    def band(window: int, n: int, causal: bool) -> Tiling:
        """Sliding window over n positions: causal i - window < j <= i, else |i - j| < window.

        Blocks of ``window`` queries below 128, else half a window (a span of 1.5 windows instead of 2: a quarter
        fewer scores, with matmuls still large enough; measured faster on CPU for windows >= 128, slower below),
        each with as many neighbouring key blocks as the window reaches.
        """
        block = min(window if window < 128 else -(-window // 2), n)
        reach = min(math.ceil((window - 1) / block), -(-n // block) - 1)
        return Tiling(block=block, back=reach, ahead=0 if causal else reach, window=Window(window, causal))

    # --- geometry -------------------------------------------------------------------------------------------------
    def single(self, nq: int) -> bool:
        """One tile of every key."""
        return self.back == 0 and self.ahead == 0 and self.block >= nq and self.rows is None

    def shape(self, nq: int, nk: int) -> tuple[int, int, int]:
        """(n_blocks, T, S): tiles, query rows per tile, keys per span."""
        if self.single(nq):
            return 1, nq, nk
        return -(-(nk if self.rows else nq) // self.block), self.rows or self.block, self.span

    @property
    def span(self) -> int:
        return (self.back + 1 + self.ahead) * self.block

    def _base(self, nq: int) -> int:
        """Span column of a row's own index, less the row: back · block (0 in a single tile)."""
        return 0 if self.single(nq) else self.back * self.block

    def index_offsets(self, nq: int, nk: int, device: torch.device | str | None = None) -> Tensor:
        """(T, S): key index - query index of every tile entry (the same in every tile)."""
        _, T, S = self.shape(nq, nk)
        return index_offsets(T, S, self._base(nq), device)

    def static_mask(self, nq: int, nk: int, device: torch.device) -> Tensor | None:
        """The (T, S) mask every tile shares: ``allow``, or the ``offsets`` rule, or None (the whole span)."""
        if self.offsets is None:
            return self.allow
        delta = self.index_offsets(nq, nk, device)
        return (delta >= self.offsets[0]) & (delta <= self.offsets[1])

    def strip(self, nq: int, nk: int) -> tuple[int, int] | None:
        """(offset, width) when every key a row r may see lies in span columns [r + offset, r + offset + width)
        inside the span (``offsets`` tilings that fit): relative terms can then be computed on that strip alone."""
        if self.offsets is None or self.rows is not None:
            return None
        lo, hi = self.offsets
        _, T, S = self.shape(nq, nk)
        base = self._base(nq)
        if base + lo < 0 or T - 1 + base + hi > S - 1:
            return None
        return base + lo, hi - lo + 1

    def key_spans(self, x: Tensor, fill: float | int | bool = 0) -> Tensor:
        """Per-key values (..., Nk) of a banded tiling -> (..., n_blocks, 1, S): the keys of each query block's span
        (``fill`` beyond the ends), a view of x padded."""
        nb = -(-x.shape[-1] // self.block)
        before, after = self.back * self.block, (nb + self.ahead) * self.block - x.shape[-1]
        return F.pad(x, (before, after), value=fill).unfold(-1, self.span, self.block)[..., None, :]

    def query_rows(self, x: Tensor, fill: float | int | bool = 0) -> Tensor:
        """Per-query values (..., Nq) of a banded tiling -> (..., n_blocks, T, 1) (``fill`` past the end)."""
        nb = -(-x.shape[-1] // self.block)
        return F.pad(x, (0, nb * self.block - x.shape[-1]), value=fill).view(*x.shape[:-1], nb, self.block, 1)

    def cell(self, i: Tensor, j: Tensor, nq: int) -> tuple[Tensor, Tensor, Tensor]:
        """(tile, row, span column) of the pairs (query i, key j); the column may lie outside [0, S)."""
        if self.single(nq):
            return torch.zeros_like(i), i, j
        T = self.rows or self.block
        tile = i // T
        return tile, i - tile * T, j - (tile - self.back) * self.block

    def key_reach(self, first: Tensor, last: Tensor, nq: int, nk: int) -> tuple[Tensor, Tensor]:
        """The first and last key index any of the queries first … last may see (clipped by the caller)."""
        if self.single(nq):
            return torch.zeros_like(first), torch.zeros_like(last) + nk - 1
        T = self.rows or self.block
        return (first // T - self.back) * self.block, (last // T + self.ahead + 1) * self.block - 1

    def label_mask(self, labels: Tensor, window: int) -> Tensor:
        """(B, H, nb, T, S) bool: the pairs whose ``labels`` (B, H, L, N) differ by less than ``window`` in some row
        (the pairs ``KeyRestrictions.labels`` leaves out), for executors that take it as a tile mask. Labels lie in
        [0, 2^59); entries past the ends get labels no window reaches. O(L · N · S) per head."""
        far = 2**60
        held = None
        for x in range(labels.shape[2]):
            label = labels[:, :, x]
            hit = (self.query_rows(label, -far) - self.key_spans(label, far)).abs_() < window
            held = hit if held is None else held.logical_or_(hit)
        return held

    def check(self, nq: int, nk: int, restrict: KeyRestrictions | None, distances: Distances | None,
              heads: tuple[int, int] | None = None) -> None:
        """A ValueError naming the problem when these inputs do not fit this tiling; ``heads``: the inputs' (B, H),
        which the per-position values (the order, groups, positions) must broadcast to."""
        single = self.single(nq)
        if self.rows is not None:
            n_blocks = -(-nk // self.block)
            if nq != n_blocks * self.rows:
                raise ValueError(f"with rows={self.rows}, q must hold ceil(Nk / block) · rows = "
                                 f"{n_blocks * self.rows} queries, got {nq}")
            if restrict is not None or self.offsets is not None or (distances is not None and distances.delta is None):
                raise ValueError("with rows, queries are not at key positions: key restrictions, offsets and "
                                 "distances by unit or positions do not apply (give distances as delta)")
            if self.tile_mask is None:
                raise ValueError("with rows, the caller gives the tile mask (it keeps out the columns beyond the "
                                 "keys)")
        elif not single and nk != nq:
            raise ValueError(f"banded tiles need as many keys as queries, got {nq} queries and {nk} keys")
        _, T, S = self.shape(nq, nk)
        if self.allow is not None and tuple(self.allow.shape) != (T, S):
            raise ValueError(f"tile mask must have shape {(T, S)}, got {tuple(self.allow.shape)}")
        if restrict is not None and (restrict.exclude_self or restrict.groups is not None) and nk != nq:
            raise ValueError("key restrictions need self-attention (as many keys as queries)")
        if distances is not None and distances.positions is not None and nk != nq:
            raise ValueError("distances by positions need self-attention (as many keys as queries)")
        if self.order is not None and (nk != nq or self.order.shape[-1] != nq):
            raise ValueError(f"Tiling.order needs self-attention and one index per position: {nq} queries, {nk} keys, "
                             f"order of length {self.order.shape[-1]}")
        if restrict is not None and restrict.labels is not None:
            lab = restrict.labels
            if not isinstance(lab, Tensor) or lab.is_floating_point() or lab.dim() != 4 or lab.shape[-1] != nq:
                raise ValueError(f"KeyRestrictions.labels must be an integer (B, H, L, N) tensor with N = {nq}")
            if nk != nq or self.rows is not None:
                raise ValueError("KeyRestrictions.labels need self-attention")
            if isinstance(restrict.label_window, bool) or not isinstance(restrict.label_window, int) \
                    or restrict.label_window < 1:
                raise ValueError(f"KeyRestrictions.label_window must be a positive integer, got "
                                 f"{restrict.label_window!r}")
        if heads is not None:
            _check_per_position(heads, nq, {"Tiling.order": self.order,
                                            "KeyRestrictions.groups": None if restrict is None else restrict.groups,
                                            "Distances.positions": None if distances is None else distances.positions})


def _check_per_position(heads: tuple[int, int], n: int, values: dict[str, Tensor | None]) -> None:
    """A ValueError naming the value that is not (B, H, N) or broadcast to it (B or H of 1): executors index every
    (batch, head)'s own row of them, and a batch of one where there are two would be read past its end."""
    B, H = heads
    for name, x in values.items():
        if x is not None and (x.dim() != 3 or x.shape[0] not in (1, B) or x.shape[1] not in (1, H)
                              or x.shape[2] != n):
            raise ValueError(f"{name} must be (B, H, N) = {(B, H, n)} or broadcast to it (B or H of 1), got "
                             f"{tuple(x.shape)}")


def index_offsets(rows: int, span: int, base: int, device: torch.device | str | None = None) -> Tensor:
    """(rows, span) long: key index - query index of tile entry (r, s), s - base - r, for tiles whose row r sees its
    own index at span column r + base."""
    return torch.arange(span, device=device)[None, :] - base - torch.arange(rows, device=device)[:, None]


def shift_invariant_mask(block: int, back: int, ahead: int, rule, *, device: torch.device | None = None) -> Tensor:
    """Tile mask (block, S) on ``device`` from ``rule(delta)`` with delta = key index - query index (a LongTensor)."""
    return rule(index_offsets(block, (back + 1 + ahead) * block, back * block, device))


__all__ = ["INDEX", "Distances", "KeyRestrictions", "Tiling", "index_offsets", "shift_invariant_mask"]
