"""Executors by name: how the pieces the patterns are built from are computed.

A pattern (``local``, ``strided``, ``fixed``, ``longformer``, ``full``, ``routing``) says which keys each query
sees and builds that from a few pieces; an executor computes the pieces without an N×N matrix. The patterns call
the default executor (``get_executor()``), so another one (a fused GPU kernel) is added by registering it and
making it the default, without touching the patterns:

    register_executor("fused", dataclasses.replace(get_executor("tiled"), name="fused", band=fused_band))
    set_default_executor("fused")

Today there is one executor, ``"tiled"`` (``tiles/``: blocked PyTorch, runs everywhere). Every operation takes
(B, H, N, D) queries, keys and values and returns ``(out, lse)``: out (B, H, N, D), zeros for a row that sees no
key, and lse (B, H, N) or None (``need_lse=False``), in float32 or wider, exactly ``neg_inf(lse.dtype)`` for a row
that sees no key; ``merge_partials`` combines parts over disjoint key sets exactly on that convention. Routing's
key restrictions (groups, the query's own key, original positions) travel as one ``KeyRestrictions`` argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .tiles import (
    KeyRestrictions,
    band_attention,
    block_diagonal_attention,
    lse_dtype,
    merge_partials,
    neg_inf,
    saw_key,
    subset_attention,
    tiled_attention,
)

OPERATIONS = ("tiled", "band", "block_diagonal", "subset")


@dataclass(frozen=True)
class Executor:
    """The operations a pattern needs, with the signatures and results of the tiled executor's functions.

    tiled: ``tiled_attention`` (query blocks against spans of neighbouring key blocks under a tile mask; one dense
        tile when block >= N), O(N · S · D) for spans of S keys.
    band: ``band_attention`` (sliding window over the sequence order), O(N · window · D).
    block_diagonal: ``block_diagonal_attention`` (within blocks of ``block`` positions), O(N · block · D).
    subset: ``subset_attention`` (every query against M chosen keys), O(N · M · D).
    """

    name: str
    tiled: Callable
    band: Callable
    block_diagonal: Callable
    subset: Callable


EXECUTORS: dict[str, Executor] = {
    "tiled": Executor("tiled", tiled_attention, band_attention, block_diagonal_attention, subset_attention),
}
_default = "tiled"


def get_executor(name: str | None = None) -> Executor:
    """The executor called ``name`` (None: the default one); a ValueError lists the known names otherwise."""
    try:
        return EXECUTORS[_default if name is None else name]
    except KeyError:
        raise ValueError(f"unknown attention executor {name!r}; known: {', '.join(EXECUTORS)}") from None


def register_executor(name: str, executor: Executor, *, replace: bool = False) -> None:
    """Make ``executor`` available as ``name``; an existing name is replaced only with ``replace=True``."""
    if name in EXECUTORS and not replace:
        raise ValueError(f"attention executor {name!r} is already registered; pass replace=True to replace it")
    missing = [op for op in OPERATIONS if not callable(getattr(executor, op, None))]
    if missing:
        raise ValueError(f"attention executor {name!r} lacks the operations {', '.join(missing)}")
    EXECUTORS[name] = executor


def set_default_executor(name: str) -> str:
    """Make the executor called ``name`` the one the patterns use; returns the previous default's name."""
    global _default
    get_executor(name)  # raises for an unknown name
    previous, _default = _default, name
    return previous


__all__ = [
    "EXECUTORS",
    "OPERATIONS",
    "Executor",
    "KeyRestrictions",
    "get_executor",
    "lse_dtype",
    "merge_partials",
    "neg_inf",
    "register_executor",
    "saw_key",
    "set_default_executor",
]
