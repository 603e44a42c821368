"""Batches of sentence pairs for an encoder-decoder model (``Seq2SeqLM``), bytes in and bytes out.

A pair (source, target) becomes the encoder's source tokens with their padding, the decoder's inputs ``START``
then the target, and the labels: the target then ``START`` again, which ends it (byte 0 occurs in no message:
``prepare gettext`` uses it as the pairs' separator). Training batches hold ``batch_size`` pairs of similar
lengths (``PairBatches``): sorted by length with a little noise, cut, the batches in random order, so that a batch
is padded little and short pairs cost little.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .store import DataError

START = 0  # the decoder's first input, and the label that ends a target
IGNORED = -100  # the label of a position that is not scored (F.cross_entropy's ignore_index)
NOISE = 8  # bytes of random length added to each pair's sorting key: other batches every epoch

Pair = tuple[bytes, bytes]


@dataclass(frozen=True)
class PairBatch:
    """``source`` (B, Ns) int64 (0 past a source's end), ``source_padding`` (B, Ns) bool (True = a real token),
    ``target_in`` (B, Nt) (``START``, then the target), ``labels`` (B, Nt) (the target, ``START``, then
    ``IGNORED``); Ns and Nt are the batch's longest source and target + 1."""

    source: Tensor
    source_padding: Tensor
    target_in: Tensor
    labels: Tensor

    def to(self, device: torch.device | str) -> PairBatch:
        return PairBatch(*(t.to(device, non_blocking=True) for t in (self.source, self.source_padding,
                                                                      self.target_in, self.labels)))


def pair_batch(pairs: Sequence[Pair]) -> PairBatch:
    """The tensors of ``pairs`` (see ``PairBatch``). O(total bytes)."""
    if not pairs:
        raise ValueError("a batch needs at least one pair")
    ns = max(1, max(len(s) for s, _ in pairs))
    nt = max(len(t) for _, t in pairs) + 1
    source = torch.zeros(len(pairs), ns, dtype=torch.long)
    padding = torch.zeros(len(pairs), ns, dtype=torch.bool)
    target_in = torch.full((len(pairs), nt), START, dtype=torch.long)
    labels = torch.full((len(pairs), nt), IGNORED, dtype=torch.long)
    for i, (s, t) in enumerate(pairs):
        if s:
            source[i, :len(s)] = torch.frombuffer(bytearray(s), dtype=torch.uint8)
        padding[i, :len(s)] = True
        if t:
            tt = torch.frombuffer(bytearray(t), dtype=torch.uint8)
            target_in[i, 1:len(t) + 1] = tt
            labels[i, :len(t)] = tt
        labels[i, len(t)] = START
    return PairBatch(source, padding, target_in, labels)


def fitting(pairs: Sequence[Pair], source_len: int, target_len: int) -> list[Pair]:
    """The pairs a model of these lengths trains on: sources of at most ``source_len`` bytes, targets of at most
    ``target_len - 1`` (the end takes a position), neither empty."""
    return [(s, t) for s, t in pairs if 0 < len(s) <= source_len and 0 < len(t) < target_len]


class PairBatches:
    """The training batches of ``pairs``, epoch after epoch: each epoch sorts the pairs by their longer side (the
    target's with its end) plus uniform noise of ``NOISE`` bytes (seeded by ``seed`` and the epoch), cuts them into
    batches and shuffles those; step s (1-based) takes the epochs' batches in turn. Batches hold ``batch_size``
    pairs (the remainder of an epoch is left to the next one's order), or with ``tokens`` > 0 as many pairs as fit
    ``tokens`` padded positions (pairs times the longest side), at most ``batch_size`` and at least ``parts``: short
    pairs then come many to a batch, as fairseq's max-tokens batches. A function of (seed, step) alone, so a resumed
    run sees the same batches. ``share`` (rank, processes) splits every batch, and ``micro_batches`` this rank's share
    again (``parts`` = processes · micro-batches, with ``tokens``)."""

    def __init__(self, pairs: Sequence[Pair], batch_size: int, *, seed: int, share: tuple[int, int] = (0, 1),
                 tokens: int = 0, parts: int = 1) -> None:
        rank, world = share
        if not tokens and batch_size % world:
            raise DataError(f"batch_size ({batch_size}) must be divisible by the number of processes ({world})")
        if len(pairs) < max(batch_size if not tokens else parts, 1):
            raise DataError(f"{len(pairs)} training pairs fit the model, fewer than a batch of "
                            f"{batch_size if not tokens else parts}")
        if tokens and batch_size < parts:
            raise DataError(f"batch_size ({batch_size}) must be at least processes times grad_accum ({parts}): every "
                            f"part of a batch holds a pair")
        self.pairs, self.batch_size, self.seed, self.rank, self.world = pairs, batch_size, seed, rank, world
        self.tokens, self.parts = tokens, parts
        self.lengths = [max(len(s), len(t) + 1) for s, t in pairs]
        self.per_epoch = len(pairs) // batch_size  # with tokens: an epoch's count varies (``_counts``)
        self._epoch: tuple[int, list[Tensor]] | None = None
        self._counts: list[int] = []  # batches in epochs 0, 1, … (with tokens)

    def order(self, epoch: int) -> list[Tensor]:
        """Epoch ``epoch``'s batches: each the indices of its pairs."""
        if self._epoch is None or self._epoch[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            lengths = torch.tensor(self.lengths, dtype=torch.float64)
            by_length = torch.argsort(lengths + torch.rand(len(self.pairs), generator=gen, dtype=torch.float64) * NOISE)
            if self.tokens:
                cut = self._cut(by_length.tolist())
            else:
                cut = list(by_length[:self.per_epoch * self.batch_size].view(self.per_epoch, self.batch_size))
            self._epoch = (epoch, [cut[i] for i in torch.randperm(len(cut), generator=gen).tolist()])
        return self._epoch[1]

    def _cut(self, order: list[int]) -> list[Tensor]:
        """Pairs in ``order`` cut greedily into batches of at most ``tokens`` padded positions (see the class)."""
        batches, current, longest = [], [], 0
        for i in order:
            n = max(longest, self.lengths[i])
            if len(current) >= self.parts and ((len(current) + 1) * n > self.tokens or
                                               len(current) == self.batch_size):
                batches.append(torch.tensor(current))
                current, n = [], self.lengths[i]
            current.append(i)
            longest = n
        if len(current) >= self.parts:  # a last batch too small to split is left to the next epoch's order
            batches.append(torch.tensor(current))
        return batches

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch within it) of step ``step``."""
        if not self.tokens:
            return divmod(step - 1, self.per_epoch)
        index, epoch = step - 1, 0
        while True:
            if epoch == len(self._counts):
                self._counts.append(len(self.order(epoch)))
            if index < self._counts[epoch]:
                return epoch, index
            index -= self._counts[epoch]
            epoch += 1

    def batch(self, step: int, micro: int = 0, micro_batches: int = 1) -> PairBatch:
        """This rank's share of micro-batch ``micro`` of step ``step``: batch_size / (world · micro_batches)
        pairs, or with ``tokens`` its part of world · micro_batches near-equal parts of the batch."""
        epoch, index = self.locate(step)
        pairs = self.order(epoch)[index]
        if self.tokens:
            if self.world * micro_batches != self.parts:
                raise DataError(f"batches cut in {self.parts} parts, asked for {self.world} x {micro_batches}")
            part, m = self.rank * micro_batches + micro, len(pairs)
            chosen = pairs[part * m // self.parts:(part + 1) * m // self.parts]
        else:
            per = self.batch_size // self.world
            if per % micro_batches:
                raise DataError(f"batch_size per process ({per}) must be divisible by grad_accum ({micro_batches})")
            size = per // micro_batches
            first = self.rank * per + micro * size
            chosen = pairs[first:first + size]
        return pair_batch([self.pairs[i] for i in chosen.tolist()])


__all__ = ["IGNORED", "NOISE", "START", "PairBatch", "PairBatches", "fitting", "pair_batch"]
