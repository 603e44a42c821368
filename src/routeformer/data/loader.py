"""Batches for training and windows for evaluation, drawn from memory-mapped token arrays.

Training batches are a pure function of (seed, step): the global batch of a step is drawn from a generator seeded
with both, and each rank takes its own slice of it. So a run resumed at step s sees exactly the batches an
uninterrupted run would, and N processes see together exactly what one process sees.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .packing import PackedRows, Rows
from .repeats import RepeatCurriculum, repeat_rows
from .store import DataError


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from ``tokens`` (inputs and next-token targets).

    ``align``: windows start at multiples of it. Data that comes in samples (images) passes the sample length, so
    that every window starts at a sample's first token and position embeddings tied to the sample's layout (an
    image's row, column and channel) are those of the tokens they embed. ``repeats``: a curriculum of repeated
    text over the first steps (``data.repeats``), for text only. ``share``: this process's (rank, number of
    processes), which split every batch. ``documents``: the split's document starts (``Dataset.starts``): ``rows``
    then gives every row's document ids, cut from the boundaries; or its whole documents packed first-fit
    (``packing.PackedRows``, of seq_len + 1 tokens a row): each row is one of those, drawn at random, with its
    documents and the predictions that count (none of padding, none across a document's end).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, *, seed: int,
                 share: tuple[int, int] = (0, 1), align: int = 1, repeats: RepeatCurriculum | None = None,
                 documents: np.ndarray | PackedRows | None = None) -> None:
        rank, world = share
        if len(tokens) < seq_len + 1:
            raise DataError(f"the train split holds {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                            f"lower seq_len (--set seq_len=...)")
        if batch_size % world:
            raise DataError(f"batch_size ({batch_size}) must be divisible by the number of processes ({world})")
        if align < 1:
            raise ValueError(f"align must be a positive integer, got {align}")
        if repeats is not None and align != 1:
            raise DataError(f"repeat_steps is a curriculum for text; this data set comes in samples of {align} tokens "
                            f"(images), whose rows must keep their layout: set repeat_steps=0")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.rank, self.world, self.align = seed, rank, world, align
        packed = documents if isinstance(documents, PackedRows) else None
        if packed is not None and (packed.length != seq_len + 1 or align != 1):
            raise DataError(f"packed rows of {packed.length} tokens for rows of seq_len + 1 = {seq_len + 1}"
                            f"{'' if align == 1 else f' in samples of {align} tokens (images)'}: pack whole documents "
                            f"into rows of seq_len + 1 tokens, of text")
        self.repeats = repeats
        self.starts = None if packed is not None else documents
        self.packed = packed

    def offsets(self, step: int) -> torch.Tensor:
        """Start of every window of the global batch of ``step``: (batch_size,)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if self.packed is not None:  # the packed rows' indices
            return torch.randint(0, len(self.packed), (self.batch_size,), generator=gen)
        starts = (len(self.tokens) - self.seq_len - 1) // self.align + 1  # windows that fit, at aligned starts
        return torch.randint(0, starts, (self.batch_size,), generator=gen) * self.align

    def batch(self, step: int, micro: int = 0, micro_batches: int = 1, length: int | None = None) -> torch.Tensor:
        """This rank's share of micro-batch ``micro`` of step ``step``: (batch_size / (world · micro_batches),
        seq_len + 1) int64 tokens; with ``length`` < seq_len (a warm-up on shorter rows), each row cut into
        seq_len / length rows of length + 1 (``cut_sequences``) before a curriculum's repeats are drawn for
        them."""
        return self.rows(step, micro, micro_batches, length).tokens

    def rows(self, step: int, micro: int = 0, micro_batches: int = 1, length: int | None = None) -> Rows:
        """``batch``'s tokens (b, L + 1), with ``documents`` the document of each (b, L + 1) int64 (else None),
        and with packed rows the predictions that count (b, L) (else None: all): a row of the curriculum's repeated
        text is one document, every prediction of it counting, its copies being what it teaches."""
        per = self.batch_size // self.world
        if per % micro_batches:
            raise DataError(f"batch_size per process ({per}) must be divisible by grad_accum ({micro_batches})")
        size = per // micro_batches
        first = self.rank * per + micro * size  # this share's first row in the global batch
        mine = self.offsets(step)[first:first + size]
        if self.packed is not None:
            rows, documents, scored = self.packed.rows(mine.tolist())
        else:
            rows = torch.from_numpy(np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1], dtype=np.int64)
                                              for o in mine.tolist()]))
            documents = None if self.starts is None else window_documents(self.starts, mine, self.seq_len + 1)
            scored = None
        pieces = 1
        if length is not None and length < self.seq_len:
            pieces = self.seq_len // length
            rows = cut_sequences(rows, length)
            documents = None if documents is None else cut_sequences(documents, length)
            scored = None if scored is None else scored.unfold(1, length, length).reshape(-1, length)
        if self.repeats is None:
            return Rows(rows, documents, scored)
        # drawn over the global batch's rows (cut or not), so that ranks and micro-batches see one run's rows
        lengths = self.repeats.lengths(self.seed, step, self.batch_size * pieces, rows.shape[1] - 1)
        mine_lengths = lengths[first * pieces:(first + size) * pieces]
        if any(mine_lengths):
            repeated = torch.tensor([n > 0 for n in mine_lengths])
            documents = None if documents is None else documents.masked_fill(repeated[:, None], 0)
            scored = None if scored is None else scored | repeated[:, None]
        return Rows(repeat_rows(rows, mine_lengths), documents, scored)


def window_documents(starts: np.ndarray, offsets: torch.Tensor, length: int) -> torch.Tensor:
    """(b, length) int64: the document of each token of the windows at ``offsets`` (b,) in a split whose documents
    start at ``starts`` (int64, increasing, from 0), by a search of them. O(b · length · log D)."""
    positions = offsets.to(torch.long)[:, None] + torch.arange(length)
    return torch.searchsorted(torch.from_numpy(np.asarray(starts)), positions, right=True) - 1


def cut_sequences(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """(B, L + 1) training tokens (inputs and the next token) -> (B · L / length, length + 1): each sequence cut
    into L / length sequences, the same tokens predicted from a shorter context (L a multiple of length)."""
    B, L = tokens.shape[0], tokens.shape[1] - 1
    if L % length:
        raise DataError(f"cannot cut sequences of {L} tokens into pieces of {length}")
    return tokens.unfold(1, length + 1, length).reshape(B * (L // length), length + 1)


def eval_windows(n: int, seq_len: int, stride: int | None = None) -> list[tuple[int, int]]:
    """Windows (start, first scored prediction) covering every prediction of a split of n tokens exactly once.

    A window is seq_len + 1 tokens from ``start`` (shorter at the end). Non-overlapping (stride = seq_len): every
    prediction of each window counts. Strided: windows advance by ``stride`` and score only their last ``stride``
    predictions, so each has at least seq_len - stride tokens of context (the first window scores all).
    """
    stride = seq_len if stride is None else stride
    if not 1 <= stride <= seq_len:
        raise DataError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    windows, start = [], 0
    while True:
        first = 0 if start == 0 else seq_len - stride
        windows.append((start, first))
        if start + seq_len >= n - 1:
            return windows
        start += stride


def window_batches(tokens: np.ndarray, windows: list[tuple[int, int]], seq_len: int, batch: int,
                   starts: np.ndarray | None = None
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(tokens (b, L + 1), score mask (b, L), documents (b, L + 1) or None) per batch; windows at the end are
    right-padded and masked. ``starts``: the split's document starts, whose ids the windows then carry (a padded
    tail in the last document)."""
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        length = min(seq_len, len(tokens) - 1 - min(start for start, _ in chunk))
        rows = np.zeros((len(chunk), length + 1), dtype=np.int64)
        mask = np.zeros((len(chunk), length), dtype=bool)
        for r, (start, first) in enumerate(chunk):
            piece = np.asarray(tokens[start:start + length + 1], dtype=np.int64)
            rows[r, :len(piece)] = piece
            mask[r, first:len(piece) - 1] = True
        documents = None
        if starts is not None:  # positions past the split's end fall in its last document
            documents = window_documents(starts, torch.tensor([s for s, _ in chunk]), length + 1)
        yield torch.from_numpy(rows), torch.from_numpy(mask), documents
