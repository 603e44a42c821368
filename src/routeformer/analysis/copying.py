"""Does a model copy what it has read? Its loss on a stretch of text read a second time, against the first reading.

A window of the split cut to its first L tokens and repeated to seq_len: every prediction after the first L is a copy
of the token L back. A model with an induction circuit (a head writing the previous token into each position, and a
head finding the position after the earlier occurrence of this one) predicts the repeat far better than the first
reading; one without it does no better, or worse (the repeat looks like nothing in its training data). The gap
between the two is the measurement; docs/training.md used it to see when the main job learned to copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data.repeats import repeat_rows


@dataclass(frozen=True)
class CopyRow:
    """One repeat length: mean loss (bits per token) over the first reading's predictions (positions 1..L-1: the
    first needs a token before it) and over the repeat's (L..seq_len), and over how many windows."""

    length: int
    first: float
    repeat: float
    windows: int

    @property
    def gain(self) -> float:
        """Bits per token the second reading saves: the first's loss minus the repeat's."""
        return self.first - self.repeat


@torch.no_grad()
def copy_gain(model: torch.nn.Module, batches: list[torch.Tensor], lengths: list[int]) -> list[CopyRow]:
    """For each L of ``lengths`` (2 <= L < seq_len), ``model``'s mean loss on the first reading and on the repeat of
    every window of ``batches`` ((b, seq_len + 1) token batches) laid out as the curriculum lays its rows
    (``data.repeats.repeat_rows``); one forward of (b, seq_len) per batch and length: O(len(lengths) · windows)
    forwards."""
    n = model.config.seq_len
    rows = []
    for length in lengths:
        if not 2 <= length < n:
            raise ValueError(f"a repeat length must be in [2, seq_len = {n}), got {length}")
        first = repeat = 0.0
        count = 0
        for batch in batches:
            tokens = repeat_rows(batch[:, :n + 1], [length] * len(batch))  # (b, n + 1): inputs and next tokens
            logits = model(tokens[:, :-1])
            nll = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
            nll = nll.view(tokens.shape[0], n) / math.log(2)  # bits; column t predicts token t + 1
            first += nll[:, :length - 1].mean(1).sum().item()
            repeat += nll[:, length - 1:].mean(1).sum().item()
            count += tokens.shape[0]
        rows.append(CopyRow(length, first / count, repeat / count, count))
    return rows


def format_copying(rows: list[CopyRow]) -> str:
    """A text table, one line per repeat length (bits per token)."""
    lines = ["| repeat length | first reading, bits per token | repeat, bits per token | saved by the repeat "
             "| windows |",
             "|--:|--:|--:|--:|--:|"]
    lines += [f"| {r.length} | {r.first:.3f} | {r.repeat:.3f} | {r.gain:+.3f} | {r.windows} |" for r in rows]
    return "\n".join(lines)
