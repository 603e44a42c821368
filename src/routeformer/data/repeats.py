"""A curriculum of repeated text: early training rows that are one stretch of text over and over.

A model predicts a repeat only once two heads work in a row, one writing into each position the token before it and
one whose query (this token) finds those keys and reads what followed (an induction circuit). On natural text that
circuit pays little until it works, so when it forms is a draw: in the main job it formed in four runs of eleven,
after 4,500 steps or more, and was worth about 0.2 bits per byte. Rows that are mostly repeats pay it at once
(measured on the main job: docs/training.md, "A curriculum of repeated text").

The choice of a step's rows is a pure function of (seed, step), drawn over the global batch, so that a resumed run
and any number of processes see exactly the rows one uninterrupted process sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RepeatCurriculum:
    """Steps 1..``steps``: each training row, with probability ``share``, is replaced by its own first L tokens
    repeated to the row's length, L uniform in [seq_len // 8, seq_len // 2] (at least 1): every later token of it is
    a copy from L back. steps >= 1 (no curriculum is no ``RepeatCurriculum``), share in (0, 1]."""

    steps: int
    share: float

    def __post_init__(self) -> None:
        if self.steps < 1 or not 0 < self.share <= 1:
            raise ValueError(f"a curriculum of repeats needs steps >= 1 and share in (0, 1], got {self.steps} and "
                             f"{self.share}")

    def lengths(self, seed: int, step: int, batch_size: int, seq_len: int) -> list[int]:
        """The repeat length of each row of the global batch of ``step`` (0: the row stays as drawn)."""
        if step > self.steps:
            return [0] * batch_size
        lo = max(1, seq_len // 8)
        hi = max(lo, seq_len // 2)
        gen = torch.Generator().manual_seed(seed * 7_000_003 + step * 31 + 17)  # a stream apart from the offsets'
        out = []
        for _ in range(batch_size):
            chosen = float(torch.rand((), generator=gen)) < self.share
            out.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)) if chosen else 0)
        return out


def repeat_rows(rows: Tensor, lengths: list[int]) -> Tensor:
    """rows (b, n) with row i replaced by its first ``lengths[i]`` tokens over and over where that is not 0; the
    rows themselves when no length is."""
    if not any(lengths):
        return rows
    out = rows.clone()
    n = rows.shape[1]
    for i, length in enumerate(lengths):
        if length:
            out[i] = rows[i, :length].repeat(n // length + 1)[:n]
    return out
