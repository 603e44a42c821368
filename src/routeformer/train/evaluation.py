"""Evaluation: mean next-token NLL over a split, in windows of seq_len, and the metric of each kind of data; during
training, the periodic validation estimate and the final score on the whole validation split (:class:`Validator`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import eval_windows, window_batches
from ..model import TransformerLM, check_token_ids
from .config import TrainConfig, overlap_stride
from .distributed import Processes, routing_in_sync, sum_all
from .parallel import Parallelism

UNITS = {"bytes": "bits per byte", "words": "perplexity", "images": "bits per dimension"}


def metric(kind: str, mean_nll: float) -> float:
    """bits per byte / dimension (nats / ln 2), or perplexity (exp) for words."""
    return math.exp(min(mean_nll, 700.0)) if kind == "words" else mean_nll / math.log(2)


def context_policy(seq_len: int, stride: int | None, documents: bool = False) -> str:
    """How a split's windows are laid, in words; ``documents``: each document scored from its own start."""
    within = "; each document from its own start, with no context from the one before" if documents else ""
    if stride is None or stride == seq_len:
        return f"non-overlapping windows of {seq_len} tokens{within}"
    return (f"windows of {seq_len} tokens every {stride}, scoring the last {stride} of each (at least "
            f"{seq_len - stride} tokens of context{' within the window' if documents else ''}){within}")


@dataclass(frozen=True)
class Scoring:
    """Which windows of a split are scored, and how many in one forward: windows of ``seq_len`` tokens every
    ``stride`` (None: seq_len, non-overlapping; else the last ``stride`` predictions of each are scored), at most
    ``max_windows`` of them evenly spaced and non-overlapping (None: all; the cheap estimate used during training),
    ``batch`` windows at a time."""

    seq_len: int
    batch: int
    stride: int | None = None
    max_windows: int | None = None


@torch.no_grad()
def evaluate(model: nn.Module, tokens: np.ndarray, scoring: Scoring, procs: Processes, *,
             autocast: contextlib.AbstractContextManager | None = None,
             progress: str | None = None, starts: np.ndarray | None = None) -> tuple[float, int]:
    """(sum of NLL in nats, number of predictions) over the split's windows (``scoring``), every prediction counted
    once, summed over ranks (each rank takes every world-th batch of windows). ``progress``: the label of a
    progress bar on stderr (windows scored, time left), shown by the main process. Where ``one_shape`` (CUDA) the
    last, short batch is padded to the shape of the others with rows that score nothing (``_padded``).
    ``starts``: the split's document starts: every window then carries its documents' ids, each document scored
    from its own start (packed documents, ``TransformerLM.forward(documents=)``)."""
    from tqdm import tqdm

    seq_len, batch, max_windows = scoring.seq_len, scoring.batch, scoring.max_windows
    windows = eval_windows(len(tokens), seq_len, scoring.stride)
    if max_windows is not None and len(windows) > max_windows:
        pick = np.linspace(0, len(windows) - 1, max_windows).round().astype(int)
        windows = [(windows[i][0], 0) for i in pick]
    mine = _my_batches(window_batches(tokens, windows, seq_len, batch, starts), -(-len(windows) // batch), procs)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    # Each rank scores every world-th batch: the main process's bar counts its own windows times the world size.
    bar = tqdm(total=len(windows), desc=progress, unit="window", dynamic_ncols=True, mininterval=1.0, leave=False,
               disable=progress is None or not procs.main)
    try:
        for rows, mask, documents in mine:
            check_token_ids(rows, model.config.vocab_size)  # on the host: no device sync
            if one_shape(procs.device):
                rows, mask, documents = _padded(rows, mask, documents, min(batch, len(windows)), seq_len)
            rows, mask = rows.to(procs.device), mask.to(procs.device)
            inputs = {} if documents is None else {"documents": documents[:, :-1].to(procs.device)}
            with autocast or contextlib.nullcontext():
                logits = model(rows[:, :-1], **inputs)
            nll = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="none")
            total += float(nll[mask.flatten()].sum())
            count += int(mask.sum())
            bar.update(min(rows.shape[0] * procs.world, bar.total - bar.n))
    finally:
        bar.close()
        model.train(was_training)
    total, count = sum_all([total, float(count)], procs)
    return total, int(count)


def one_shape(device: torch.device) -> bool:
    """Whether evaluation batches all take one shape on ``device``: on CUDA, where FlexAttention's kernels are
    compiled per shape (seconds each). Elsewhere a short last batch costs less than padding it."""
    return device.type == "cuda"


def _padded(rows: torch.Tensor, mask: torch.Tensor, documents: torch.Tensor | None, batch: int,
            seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A batch of windows (b, L + 1), its score mask (b, L) and documents (b, L + 1) or None grown to
    (batch, seq_len + 1) with rows that score nothing (a padded tail in its row's last document): the last, short
    batch of a split then has the shape of the others, and FlexAttention's kernels, compiled per shape, are not
    compiled again for it (on CUDA; each recompilation costs seconds)."""
    b, length = mask.shape
    if (b, length) == (batch, seq_len):
        return rows, mask, documents
    full = rows.new_zeros(batch, seq_len + 1)
    full[:b, :length + 1] = rows
    scored = mask.new_zeros(batch, seq_len)
    scored[:b, :length] = mask
    if documents is not None:
        ids = documents.new_zeros(batch, seq_len + 1)
        ids[:b] = documents[:, -1:]
        ids[:b, :length + 1] = documents
        documents = ids
    return full, scored, documents


def _my_batches(batches: Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], count: int,
                procs: Processes) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """This rank's share (every world-th) of ``count`` batches, the same number on every rank: a sharded model
    gathers its parameters collectively in each forward, so a rank left without a batch in the last round runs
    the split's first batch with a mask that scores nothing."""
    first = None
    for i, (rows, mask, documents) in enumerate(batches):
        first = (rows, mask, documents) if i == 0 else first
        if i % procs.world == procs.rank:
            yield rows, mask, documents
    if first is not None and -(-count // procs.world) > len(range(procs.rank, count, procs.world)):
        yield first[0], torch.zeros_like(first[1]), first[2]


class Validator:
    """The validation split scored during training, with ``core`` (the unwrapped model) under ``autocast``: a cheap
    estimate every ``eval_every`` steps and the whole split at the end, each written as a row of metrics by
    ``write``."""

    def __init__(self, core: TransformerLM, tokens: np.ndarray, kind: str, cfg: TrainConfig, parallel: Parallelism,
                 write: Callable[[dict], None], *, starts: np.ndarray | None = None) -> None:
        seq_len, procs = core.config.seq_len, parallel.procs
        self.core, self.tokens, self.kind, self.seq_len = core, tokens, kind, seq_len
        self.starts = starts  # the split's document starts, where the run keeps the boundaries
        self.procs, self.autocast, self.write = procs, parallel.autocast, write
        self.max_windows = max(1, cfg.eval_tokens // seq_len)
        micro = max(1, cfg.batch_size // max(1, procs.world * cfg.grad_accum))
        self.batch = 4 * micro  # no gradients to keep: larger batches than training's, for throughput
        self.stride = overlap_stride(seq_len, cfg.eval_overlap)

    def estimate(self, step: int) -> float:
        """Mean NLL on ``eval_tokens`` of the split in evenly spaced windows; also checks that every rank holds the
        same routing centroids."""
        mean = self._mean(Scoring(self.seq_len, self.batch, max_windows=self.max_windows))
        in_sync = routing_in_sync(self.core, self.procs)
        if not in_sync:
            raise RuntimeError("routing centroids differ between ranks; this is a bug, please report it")
        self.write({"step": step, "split": "valid", "loss": mean, "value": metric(self.kind, mean),
                    "routing_in_sync": in_sync})
        return mean

    def whole_split(self, step: int) -> float:
        """Mean NLL over the whole split in windows every ``stride`` tokens (``config.overlap_stride``), with a
        progress bar: it can take minutes."""
        mean = self._mean(Scoring(self.seq_len, self.batch, stride=self.stride), progress="final evaluation")
        self.write({"step": step, "split": "valid_full", "loss": mean, "value": metric(self.kind, mean),
                    "context": self.context})
        return mean

    @property
    def context(self) -> str:
        """How the whole split's windows are laid (``context_policy``)."""
        return context_policy(self.seq_len, self.stride, documents=self.starts is not None)

    def _mean(self, scoring: Scoring, progress: str | None = None) -> float:
        total, count = evaluate(self.core, self.tokens, scoring, self.procs, autocast=self.autocast(),
                                progress=progress, starts=self.starts)
        return total / max(count, 1)
