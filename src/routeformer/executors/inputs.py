"""The values an attention call hands down the stack: the checked inputs, and the relative-position terms.

A public attention function checks its arguments once (``check_inputs``) and passes one ``Inputs`` value to the
executor, as xformers' fmha passes one inputs value; the relative terms travel as one ``RelTerms`` value (the
tables and how far apart each pair is), never as two arguments that must agree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from ..checks import check_key_padding_mask, check_qkv, check_scale
from ..documents import CrossDocuments, check_cross_documents, check_documents
from .relative import RelativePositions
from .tiling import INDEX, Distances


@dataclass(frozen=True)
class Inputs:
    """Queries (B, H, Nq, D), keys and values (B, H, Nk, D), the score scale, the keys' validity (B, 1 or H,
    Nk) bool or None (every key real) and the positions' documents (B, N) long or None (one document a row): each
    row's documents numbered from 0 (``documents.check_documents``); a query sees only keys of its own document.
    Made by ``check_inputs`` at a public function; an executor trusts it."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    key_valid: Tensor | None = None
    scale_given: bool = False  # whether the caller chose the scale (a kernel without one, elu, refuses it)
    documents: Tensor | None = None
    is_cross: bool = False  # the keys and values are another sequence's (a memory, Nk may differ): ``Inputs.cross``
    cross_documents: CrossDocuments | None = None  # a memory's packed documents and its queries' (``Inputs.cross``)

    @classmethod
    def of(cls, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
           key_padding_mask: Tensor | None = None, documents: Tensor | None = None) -> Inputs:
        """The checked inputs of an attention call, for the public functions (``local_attention(Inputs.of(q, k, v),
        LocalOptions(window=64))``): q (B, H, N, D), k and v the same shape, ``scale`` (None: 1/sqrt(D)), a
        (B, N) key padding mask (True = a real key) and (B, N) integer document ids that never decrease along a
        row (packed documents: a query sees only its own document's keys; ``routeformer.documents`` makes them from
        lengths, ``cu_seqlens`` or separators). Every error names the argument and the shape it needs."""
        return check_inputs(q, k, v, scale, key_padding_mask, documents=documents)

    @classmethod
    def cross(cls, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
              key_padding_mask: Tensor | None = None, documents: CrossDocuments | None = None) -> Inputs:
        """The checked inputs of a cross-attention call: queries q (B, H, Nq, D) of one sequence against a memory's
        keys and values k, v (B, H, Nk, D) (an encoder's output; Nk may differ from Nq), ``scale`` (None:
        1/sqrt(D)), the memory's (B, Nk) padding mask (True = a real key) and packed documents on both sides
        (``documents.CrossDocuments``: query document d reads memory document d only). Positions of the two
        sequences are not comparable: the kinds that read them (windows, causal masks, relative positions) refuse
        these inputs (``attention.cross``: the kinds that take them)."""
        B, H, Nq, D = check_qkv(q, k, v, cross=True)
        mask = check_key_padding_mask(key_padding_mask, B, k.shape[2], q.device)
        return cls(q, k, v, check_scale(scale, D), None if mask is None else mask[:, None, :],
                   scale_given=scale is not None, is_cross=True,
                   cross_documents=check_cross_documents(documents, B, Nq, k.shape[2], q.device))

    @property
    def chosen_scale(self) -> float | None:
        """The scale the caller chose, or None when it is the default 1/sqrt(D) (a kernel without a scale, elu,
        refuses a chosen one; poly2 reads None as its own default)."""
        return self.scale if self.scale_given else None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, N, D) of the queries."""
        B, H, N, D = self.q.shape
        return B, H, N, D

    def head_range(self, start: int, stop: int) -> Inputs:
        """The inputs of heads start … stop - 1 (a key validity per head is cut too)."""
        valid = self.key_valid
        if valid is not None and valid.shape[1] > 1:
            valid = valid[:, start:stop]
        return dataclasses.replace(self, q=self.q[:, start:stop], k=self.k[:, start:stop], v=self.v[:, start:stop],
                                   key_valid=valid)

    def keys_at(self, index: Tensor) -> Inputs:
        """The inputs with only the keys (and values, and their validity) at positions ``index`` (M,), gathered,
        and no documents: a query then sees a subset of the keys that its caller laid out (within its document)."""
        valid = self.key_valid
        return dataclasses.replace(self, k=self.k[:, :, index], v=self.v[:, :, index], documents=None,
                                   key_valid=None if valid is None else valid[:, :, index])

    def with_(self, **changes) -> Inputs:
        """The same inputs with some fields replaced (the heads of a split, the columns of a grid, ...)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RelTerms:
    """Shaw et al.'s relative-position terms of one call: the tables, and the distance of every pair
    (``tiling.Distances``: by index, explicit per tile entry, or between given positions)."""

    tables: RelativePositions
    distances: Distances  # no default: dynamo before 2.13 cannot wrap a dataclass field's default (INDEX)

    def at(self, distances: Distances) -> RelTerms:
        """The same tables at other distances."""
        return RelTerms(self.tables, distances)


def relative(rel_pos: RelativePositions | None, distances: Distances | None = None) -> RelTerms | None:
    """``rel_pos`` at ``distances`` (default ``INDEX``) as one value, or None without tables."""
    # INDEX read here, not as the parameter's default: dynamo before 2.13 cannot wrap a default value's dataclass
    return None if rel_pos is None else RelTerms(rel_pos, INDEX if distances is None else distances)


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None,
    key_padding_mask: Tensor | None,
    rel_pos: RelativePositions | None = None,
    *,
    documents: Tensor | None = None,
) -> Inputs:
    """Validate q, k, v (B, H, N, D), the scale (None: 1/sqrt(D)), a (B, N) key padding mask (True = a real key),
    relative-position tables and (B, N) document ids; the checked ``Inputs``."""
    B, H, N, D = check_qkv(q, k, v)
    resolved = check_scale(scale, D)
    mask = check_key_padding_mask(key_padding_mask, B, N, q.device)
    check_rel(rel_pos, q)
    return Inputs(q, k, v, resolved, None if mask is None else mask[:, None, :], scale_given=scale is not None,
                  documents=check_documents(documents, B, N, q.device))


def refuse_documents(inputs: Inputs, what: str) -> None:
    """A ValueError where ``inputs`` carry documents that ``what`` cannot honour (no silent attention across
    them)."""
    if inputs.documents is not None:
        raise ValueError(f"documents: {what} does not honour packed documents yet; run each document apart, or "
                         f"use a kind that does (docs/attention.md, 'Packed documents')")


def refuse_cross_documents(inputs: Inputs, what: str) -> None:
    """A ValueError where cross-attention ``inputs`` carry packed documents that ``what`` cannot honour."""
    if inputs.cross_documents is not None:
        raise ValueError(f"documents: {what} does not honour packed documents across two sequences yet; run each "
                         f"pair apart (every cross kind's forward honours them)")


def refuse_cross(inputs: Inputs, what: str) -> None:
    """A ValueError where ``inputs`` are cross-attention's (``Inputs.cross``) and ``what`` compares positions of
    the queries with the memory's, which have no common order: windows, causal masks, relative positions."""
    if inputs.is_cross:
        raise ValueError(f"cross-attention: {what} compares query positions with memory positions, which have no "
                         f"meaning across two sequences; cross-attention kinds: {', '.join(CROSS_KINDS)} "
                         f"(non-causal, without relative positions)")


CROSS_KINDS = ("full", "routing", "moba", "performer", "linear")  # those with a cross-attention form


def check_rel(rel: RelativePositions | None, q: Tensor) -> RelTerms | None:
    """Check relative-position tables against the queries (B, H, N, D) they score; the call's ``RelTerms`` (at
    ``INDEX``), or None without tables."""
    if rel is None:
        return None
    if not isinstance(rel, RelativePositions):
        raise ValueError(f"rel must be a RelativePositions module or None, got {type(rel).__name__}")
    rel.check(q)
    return relative(rel)
