"""Packed documents: which document every position of a row belongs to, as one (B, N) tensor, ``documents``.

Several documents packed into one row must not see each other: query i attends only keys of its own document.
Attention takes the ids as ``Inputs.of(q, k, v, documents=...)``; they never decrease along a row (a document is
one run of positions). The checked form numbers each row's documents 0, 1, 2 … from its first position
(``check_documents``), whatever ids were given, so that a document index is below N and two ids combine into one
label (a cluster or bucket within a document) without overflow.

The constructors meet people where their data is: FlashAttention's ``cu_seqlens`` (the cumulative lengths of a
flat batch), each row's document lengths, or a separator token that ends a document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


def check_documents(documents: Tensor | None, batch: int, n: int, device: torch.device) -> Tensor | None:
    """Check (B, N) integer document ids that never decrease along a row; return them numbered from 0 within each
    row (int64, +1 at every boundary), or None where no row holds a boundary (a row of one document is a row
    without documents: the plain path, with none of their cost). Every error names the argument. O(B · N), one
    read of the device (whether any id decreases, whether any changes)."""
    if documents is None:
        return None
    documents = _check_form(documents, batch, n, device)
    return _numbered(documents, documents.diff(dim=-1))


def _check_form(documents: object, batch: int, n: int, device: torch.device, name: str = "documents",
                shape: str = "(B, N)") -> Tensor:
    """``documents`` as a (B, N) integer tensor on ``device``, or a ValueError naming what is wrong (as ``name``)."""
    if not isinstance(documents, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of {shape} integer ids, got {type(documents).__name__}")
    if documents.dtype == torch.bool or documents.is_floating_point() or documents.is_complex():
        raise ValueError(f"{name} must be an integer tensor of document ids, got dtype {documents.dtype}")
    if tuple(documents.shape) != (batch, n):
        raise ValueError(f"{name} must have shape {shape} = {(batch, n)}, got {tuple(documents.shape)}")
    if documents.device != device:
        raise ValueError(f"{name} is on {documents.device} but q is on {device}")
    return documents


def _numbered(documents: Tensor, step: Tensor) -> Tensor | None:
    """check_documents' numbering, given the ids' steps along each row."""
    decreasing, boundary = torch.stack([(step < 0).any(), (step != 0).any()]).tolist()
    if not boundary:
        return None
    if decreasing:
        b, i = (step < 0).nonzero()[0].tolist()
        raise ValueError(f"documents must never decrease along a row (a document is one run of positions): row {b} "
                         f"goes from {int(documents[b, i])} to {int(documents[b, i + 1])} at position {i + 1}")
    return torch.cat([torch.zeros_like(documents[:, :1], dtype=torch.long),
                      (step != 0).long().cumsum(-1)], dim=-1)


class CrossDocuments(NamedTuple):
    """Packed documents across two sequences, for cross-attention: ``queries`` (B, Nq) and ``memory`` (B, Nk)
    integer ids that never decrease along a row. Document d of a row's queries reads only document d of its memory
    (the d-th run of ids on each side, whatever the ids: a row of packed (source, target) pairs, target d reading
    source d). ``check_cross_documents`` numbers both sides from 0."""

    queries: Tensor
    memory: Tensor


def check_cross_documents(documents: CrossDocuments | None, batch: int, nq: int, nk: int,
                          device: torch.device) -> CrossDocuments | None:
    """Check ``CrossDocuments``: each side's form and order as ``check_documents`` does, and as many documents on
    both sides of every row. Returns both numbered from 0 within each row (int64), or None where no row holds a
    boundary on either side (one document a row: the plain path). Errors name the side and the row. O(B · (Nq +
    Nk)), one read of the device."""
    if documents is None:
        return None
    if not isinstance(documents, CrossDocuments):
        raise ValueError(f"documents must be CrossDocuments(queries=(B, Nq) ids, memory=(B, Nk) ids) for "
                         f"cross-attention, got {type(documents).__name__}")
    sides = []
    for name, ids, n in (("queries", documents.queries, nq), ("memory", documents.memory, nk)):
        ids = _check_form(ids, batch, n, device, f"documents.{name}", "(B, Nq)" if name == "queries" else "(B, Nk)")
        step = ids.diff(dim=-1)
        if bool((step < 0).any()):
            b, i = (step < 0).nonzero()[0].tolist()
            raise ValueError(f"documents.{name} must never decrease along a row (a document is one run of "
                             f"positions): row {b} goes from {int(ids[b, i])} to {int(ids[b, i + 1])} at position "
                             f"{i + 1}")
        sides.append(torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.long), (step != 0).long().cumsum(-1)], -1))
    queries, memory = sides
    counts = torch.stack([queries[:, -1], memory[:, -1]]).T  # (B, 2): each row's last document on each side
    if bool((counts[:, 0] != counts[:, 1]).any()):
        b = int((counts[:, 0] != counts[:, 1]).nonzero()[0, 0])
        raise ValueError(f"documents: row {b} packs {int(counts[b, 0]) + 1} query documents but "
                         f"{int(counts[b, 1]) + 1} memory documents; every document needs positions on both sides")
    if not bool(counts.any()):
        return None
    return CrossDocuments(queries, memory)


class DocumentSpans(NamedTuple):
    """Packed documents of the positions a decoding forward adds, start … start + n - 1 (``continue_documents``).

    numbered: (B, n) the ids as ``check_documents`` numbers them (what a prompt's forward takes), or None where
    they hold no boundary or none is crossed; since: (B, n) long, the first position of each one's document (the row's
    earlier positions before it are not seen); new: (B, n) bool, whether the position begins a document (its
    token shift reads nothing before it); last: (B,) the ids of the rows' last positions, as given (the next
    forward continues them); crosses: whether any of these positions lies past a boundary (a document that began
    after the row's first position): where none does, the positions decode as one document a row."""

    numbered: Tensor | None
    since: Tensor
    new: Tensor
    last: Tensor
    crosses: bool


def continue_documents(documents: Tensor, batch: int, n: int, device: torch.device, start: int,
                       before: DocumentSpans | None) -> DocumentSpans:
    """The spans of n positions from ``start`` whose (B, n) ids continue a decoded row: they never decrease along it,
    from the last id ``before`` saw (None: positions before ``start`` were one document, and an id that differs
    from the cache's first one is a new document only within these positions). Errors name the argument. O(B · n),
    one read of the device."""
    documents = _check_form(documents, batch, n, device).long()
    previous = documents[:, :1] if before is None else before.last[:, None].to(documents.device)
    step = torch.diff(documents, dim=-1, prepend=previous)  # (B, n): from the position before each
    new = step != 0
    first = torch.zeros(batch, dtype=torch.long, device=device) if before is None else before.since[:, -1]
    positions = torch.arange(start, start + n, device=device)
    since = torch.where(new, positions, first[:, None]).cummax(-1).values  # (B, n): starts only move on
    decreasing, crosses = torch.stack([(step < 0).any(), (since > 0).any()]).tolist()
    if decreasing:
        b, i = (step < 0).nonzero()[0].tolist()
        was = int(previous[b, 0]) if i == 0 else int(documents[b, i - 1])
        raise ValueError(f"documents must never decrease along a row, the cached positions included: row {b} goes "
                         f"from {was} to {int(documents[b, i])} at position {start + i}")
    numbered = check_documents(documents, batch, n, device) if crosses else None
    return DocumentSpans(numbered, since, new, documents[:, -1], crosses)


def documents_from_lengths(lengths: Sequence[Sequence[int]]) -> Tensor:
    """(B, N) document ids from each row's document lengths, in order (every row's summing to the same N):
    ``documents_from_lengths([[3, 5], [8]])`` -> [[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]]."""
    if isinstance(lengths, Tensor) or not isinstance(lengths, Sequence) or not lengths \
            or not all(isinstance(row, Sequence) for row in lengths):
        raise ValueError("lengths must be a non-empty list of rows, each a list of its documents' lengths")
    rows = []
    for b, row in enumerate(lengths):
        if not row or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in row):
            raise ValueError(f"lengths: row {b} must list positive integer lengths, got {list(row)!r}")
        rows.append(torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)))
    sizes = {r.numel() for r in rows}
    if len(sizes) > 1:
        raise ValueError(f"lengths: every row must sum to the same N, got sums {[r.numel() for r in rows]}")
    return torch.stack(rows)


def documents_from_cu_seqlens(cu_seqlens: Tensor, batch: int = 1) -> Tensor:
    """(B, N) document ids from FlashAttention's varlen ``cu_seqlens`` (D + 1,) int: 0, then the running total of the
    D documents' lengths, over a flat sequence of B · N tokens laid out as ``batch`` rows of N (a document running
    past a row's end continues as a document of the next row). O(B · N)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() \
            or cu_seqlens.dtype == torch.bool or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D integer tensor: 0, then the running total of the lengths")
    if int(cu_seqlens[0]) != 0 or bool((cu_seqlens.diff() <= 0).any()):
        raise ValueError(f"cu_seqlens must start at 0 and increase (every document at least one token), got "
                         f"{cu_seqlens.tolist()}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    total = int(cu_seqlens[-1])
    if total % batch:
        raise ValueError(f"cu_seqlens holds {total} tokens, which {batch} rows cannot share equally")
    flat = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.long), flat, right=True).view(batch, total // batch)


def documents_from_separators(tokens: Tensor, separator: int) -> Tensor:
    """(B, N) document ids from tokens (B, N) in which ``separator`` ends a document: the separator belongs to the
    document it ends, the next token starts the next one (a model then predicts the separator from the document it
    ends, and the first token of the next from nothing before it). O(B · N)."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError("tokens must be a (B, N) integer tensor")
    if isinstance(separator, bool) or not isinstance(separator, int):
        raise ValueError(f"separator must be a token id (int), got {separator!r}")
    ends = (tokens == separator).long()
    return torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1].cumsum(-1)], dim=-1)


__all__ = ["CrossDocuments", "check_cross_documents", "check_documents", "documents_from_cu_seqlens",
           "documents_from_lengths", "documents_from_separators"]
