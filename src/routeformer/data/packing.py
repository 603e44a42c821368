"""Whole documents packed first-fit into training rows (``TrainConfig.pack = "documents"``).

A row of ``length`` tokens (a model's inputs and their next-token targets, seq_len + 1) holds pieces of documents
that never share a row position with anything else: a document of up to ``length`` tokens is one piece; a longer one
is cut into pieces of ``length`` tokens every ``length - 1`` (each piece begins with its predecessor's last token,
so that every token of a document but its first is predicted exactly once, from its own document only). Pieces of
the split are placed in a seeded random order, each into the first row with room for it (first-fit), so rows that
one whole piece fills stand alone and the short ones (short documents, documents' tails) share rows; the rest of a
row is padding. A row's ``scored`` targets are the predictions within one piece: none across a piece's end (the
next piece is another document, or the same document's next piece, which predicts that token itself) and none of
padding.

The rows are a pure function of the split, its starts, ``length`` and the seed: built once, O(P log R) for P pieces
and R rows, and drawn by index (``BatchSampler``), so resumed and distributed runs see the same rows.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .store import DataError


class Rows(NamedTuple):
    """Training rows: ``tokens`` (b, L + 1) int64; ``documents`` (b, L + 1) int64, each token's document numbered
    from 0 along its row, or None where the run ignores documents; ``scored`` (b, L) bool, which next-token
    predictions count in the loss, or None for all of them."""

    tokens: Tensor
    documents: Tensor | None
    scored: Tensor | None


def first_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The bin of every item (int64, (P,)): items of ``lengths`` (each 1 … capacity) taken in order, each into the
    lowest-numbered bin whose room is at least its length, a new bin where none has room. O(P log P): a tree of the
    bins' largest room finds the first that fits."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"first_fit: every length must be in [1, capacity={capacity}], got "
                         f"{int(lengths.min())} … {int(lengths.max())}")
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    room = np.zeros(2 * size, dtype=np.int64)  # room[size + b]: bin b's room (0 for a bin not yet opened)
    bins = np.empty(len(lengths), dtype=np.int64)
    opened = 0
    for i, need in enumerate(lengths.tolist()):
        if need == capacity:  # only a new bin has this much room, and it is left with none: the tree is unchanged
            bins[i], opened = opened, opened + 1
            continue
        if room[1] >= need:  # the leftmost bin with room: walk down the tree
            node = 1
            while node < size:
                node = 2 * node if room[2 * node] >= need else 2 * node + 1
            b = node - size
        else:
            b, opened = opened, opened + 1
            room[size + b] = capacity
        bins[i] = b
        node = size + b
        room[node] -= need
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


class PackedRows:
    """The split's documents packed first-fit into rows of ``length`` tokens (module docstring).

    ``tokens``: the split (memory-mapped); ``starts``: its document starts (int64, increasing, from 0); ``seed``:
    the order in which pieces are placed. ``len()`` rows; ``rows(indices)`` assembles some of them."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, length: int, seed: int) -> None:
        if length < 2:
            raise DataError(f"packed rows need at least 2 tokens (an input and its target), got {length}")
        ends = np.append(np.asarray(starts, dtype=np.int64)[1:], len(tokens))
        first, sizes = [], []
        for start, end in zip(np.asarray(starts, dtype=np.int64).tolist(), ends.tolist(), strict=True):
            # pieces of `length` every `length - 1`: consecutive pieces share one token
            for s in range(start, max(start + 1, end - 1), length - 1):
                if end - s >= 2:  # a piece predicts at least one token
                    first.append(s)
                    sizes.append(min(length, end - s))
        if not first:
            raise DataError("no document of this split has 2 tokens: nothing to train on in packed rows")
        order = np.random.default_rng(seed).permutation(len(first))
        self.first = np.asarray(first, dtype=np.int64)[order]
        self.sizes = np.asarray(sizes, dtype=np.int64)[order]
        self.row = first_fit(self.sizes, length)
        # each row's pieces, in the order they were placed: (row, placement) sorted
        by_row = np.argsort(self.row, kind="stable")
        self.pieces = by_row
        self.bounds = np.searchsorted(self.row[by_row], np.arange(int(self.row.max()) + 2))
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def padding(self) -> float:
        """The share of the rows' positions that are padding."""
        return 1.0 - float(self.sizes.sum()) / (len(self) * self.length)

    def rows(self, indices: list[int]) -> Rows:
        """Rows ``indices``: their tokens (padding 0), documents (each piece its own, padding one more) and
        scored predictions (within a piece)."""
        b, L = len(indices), self.length
        tokens = np.zeros((b, L), dtype=np.int64)
        documents = np.zeros((b, L), dtype=np.int64)
        scored = np.zeros((b, L - 1), dtype=bool)
        for r, index in enumerate(indices):
            at = 0
            for d, piece in enumerate(self.pieces[self.bounds[index]:self.bounds[index + 1]].tolist()):
                s, n = int(self.first[piece]), int(self.sizes[piece])
                tokens[r, at:at + n] = self.tokens[s:s + n]
                documents[r, at:at + n] = d
                scored[r, at:at + n - 1] = True
                at += n
            documents[r, at:] = documents[r, at - 1] + 1
        return Rows(torch.from_numpy(tokens), torch.from_numpy(documents), torch.from_numpy(scored))
