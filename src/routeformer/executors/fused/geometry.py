"""The fused operators' geometries: the ``int[] geometry`` each attention operator takes, as a frozen dataclass of
named fields (``ints()`` is the list, in field order). The C++ side holds a struct of the same fields, parsed and
checked by name in one place (``csrc/geometry.h``); ``check_fields`` compares the two lists of names once when the
library loads, so a field added, removed or moved on one side only is an error naming both lists, not a value read
as another field.

An int list rather than a registered custom class: torch.compile traces an int list as a constant argument (the fake
implementations in ``op.py`` read it as one), where a script object would need a fake class of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class _Geometry:
    def ints(self) -> list[int]:
        """The operator's int list: every field in order, flags as 0 or 1."""
        return [int(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def index(cls, name: str) -> int:
        """The position of field ``name`` in the list (the fake implementations read a field by it)."""
        return cls.names().index(name)


@dataclass(frozen=True)
class BandGeometry(_Geometry):
    """``band_forward`` / ``band_backward``: a ``Tiling`` and what the kernel does with it."""

    block: int  # a tiling block's rows (queries, and keys per span block)
    back: int  # key blocks behind a query block
    ahead: int  # key blocks ahead of it
    rows: int  # query rows per tile when queries are not at key positions (0: none)
    single: bool  # one tile of every query and key
    has_offsets: bool  # offsets that are not a window's narrow each row to [i + off_lo, i + off_hi]
    off_lo: int
    off_hi: int
    window: int  # a sliding window (``tiling.Window``; 0: none): the kernel narrows row i to [i + 1 - window, i]
    causal: bool  # that window's side: [i + 1 - window, i + window - 1] when not causal
    exclude_self: bool  # the own key only when a row sees nothing else
    unit: int  # relative distances (key - query) · unit; 0: from delta or positions
    max_distance: int  # the relative tables' clipping distance (0 without tables)
    rows_per_block: int  # the kernel's blocks of consecutive rows (the blocking alone: no effect on results)
    positions_from_order: bool  # relative distances between the order's entries (order[j] - order[i])


@dataclass(frozen=True)
class RangesGeometry(_Geometry):
    """``ranges_forward`` / ``ranges_backward``: entries of query rows against ranges of keys."""

    merge: int  # entries per query row, merged into one softmax
    rows_per_block: int  # entries per kernel block (the blocking alone)
    span_cap: int  # the most keys a block's ranges span together (the blocking alone)
    max_distance: int  # the relative tables' clipping distance (0 without tables)


@dataclass(frozen=True)
class RoundsGeometry(_Geometry):
    """``rounds_forward`` / ``rounds_backward``: LSH's rounds."""

    window: int  # each round's sliding window over its sorted order
    rows_per_block: int  # sorted indices per kernel block (the blocking alone)
    causal: bool


GEOMETRIES: dict[str, type[_Geometry]] = {"band": BandGeometry, "ranges": RangesGeometry, "rounds": RoundsGeometry}


def check_fields() -> None:
    """Compare each dataclass's field names with the loaded library's struct (``geometry_fields``); a mismatch is an
    error naming both lists (a stale build, or a field changed on one side only)."""
    for which, cls in GEOMETRIES.items():
        native = tuple(torch.ops.routeformer_fused.geometry_fields(which))
        if native != cls.names():
            raise RuntimeError(f"routeformer: the fused kernel's {which} geometry has the fields {list(native)} but "
                               f"fused/geometry.py's {cls.__name__} has {list(cls.names())}: both sides must list "
                               f"the same fields in the same order (csrc/geometry.h, RF_{which.upper()}_GEOMETRY)")
