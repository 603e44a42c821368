"""Training an encoder-decoder model on a pairs data set (``routeformer train --config translate``).

The same run as a language model's (trainer.py), part for part: the run directory, the checkpoint and its exact
resume, DDP across torchrun processes, the stop signals, the time budget and the schedule; what differs is what a
step reads (``PairBatches``: batches of pairs of similar lengths; the loss per target byte, the end included), what
validation scores (``PairValidator``: bits per target byte over the pairs that fit), and the end: the validation
split translated greedily and scored with chrF and BLEU beside copying the source (``translation``), and one
translation shown.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import DataError, Dataset, read_pairs
from ..data.pairs import IGNORED, Pair, PairBatches, fitting, pair_batch
from ..model.seq2seq import Seq2SeqConfig, Seq2SeqLM
from . import distributed
from .evaluation import metric
from .loop import Loop, Parts, Services, run_loop, schedule_warnings
from .parallel import Parallelism, TrainingForward, resolve_precision
from .result import Seq2SeqResult
from .seq2seq_config import Seq2SeqRun
from .setup import start_run
from .signals import StopRequest
from .translation import require_sacrebleu, score, translate_all

KIND = "bytes"  # the metric: bits per target byte


@dataclass(frozen=True)
class PairsData:
    """A pairs data set's splits as the model takes them: ``train`` and ``valid`` the pairs that fit its lengths
    (``fitting``), ``valid_all`` every validation pair (translated and scored at the end, sources cut to fit), and
    how many of each split were left out."""

    data: Dataset
    train: list[Pair]
    valid: list[Pair]
    valid_all: list[Pair]
    left_out: dict[str, int]


def open_pairs(run: Seq2SeqRun) -> PairsData:
    """The run's pairs data set, checked against its model: a pairs data set, bytes, splits that hold pairs that
    fit."""
    data = Dataset.open(run.train.data, run.train.data_dir)
    vocab = run.model.decoder.vocab_size
    if vocab != data.meta.vocab_size:
        raise DataError(f"the model's vocab_size ({vocab}) does not match the vocabulary of data set "
                        f"{data.meta.name!r} ({data.meta.vocab_size}); set "
                        f"--set model.vocab_size={data.meta.vocab_size}")
    (train, train_all), (valid, valid_all) = (split_pairs(data, split, run.model) for split in ("train", "valid"))
    return PairsData(data, train, valid, valid_all,
                     {"train": len(train_all) - len(train), "valid": len(valid_all) - len(valid)})


def split_pairs(data: Dataset, split: str, model: Seq2SeqConfig) -> tuple[list[Pair], list[Pair]]:
    """The pairs of ``split`` that fit ``model``'s lengths (``fitting``), and all of them; a DataError where none
    fits."""
    ns, nt = model.encoder.seq_len, model.decoder.seq_len
    every = read_pairs(data, split)
    kept = fitting(every, ns, nt)
    if not kept:
        raise DataError(f"no {split} pair of {data.meta.name!r} fits a source of {ns} bytes and a target of "
                        f"{nt - 1}; raise encoder.seq_len / decoder.seq_len")
    return kept, every


def batch_words(cfg) -> str:
    """How the banner says a batch's size."""
    if cfg.batch_tokens:
        return f"up to {cfg.batch_tokens:,} padded bytes and {cfg.batch_size} pairs"
    return f"{cfg.batch_size} pairs"


class PairLoop(Loop):
    """The training loop (``Loop``) over batches of pairs: a step's micro-batches come from ``PairBatches``, the
    loss is the mean NLL per target byte (the end included) plus the routing heads' commitment."""

    def step(self, step: int, time_share: float = 0.0) -> float:
        cfg = self.cfg
        self.start_step(step, time_share)
        losses = []
        for micro in range(cfg.grad_accum):
            batch = self.sampler.batch(step, micro, cfg.grad_accum)
            # the target bytes scored, counted on this rank (on the host) and scaled by the ranks: the speed's count
            self.tokens += int((batch.labels != IGNORED).sum()) * self.procs.world
            batch = batch.to(self.procs.device)
            last = micro == cfg.grad_accum - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                with self.parallel.autocast():
                    logits = self.model.eager(batch.source, batch.target_in, batch.source_padding)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORED)
                    objective = (loss + self.core.aux_loss.float()) / cfg.grad_accum
                self.parallel.scaler.scale(objective).backward()
            losses.append(loss.detach())
        return self.finish_step(step, losses)


class PairValidator:
    """Bits per target byte on the validation pairs, with ``core`` under the run's autocast: an estimate on evenly
    spaced pairs holding about ``eval_tokens`` target bytes every ``eval_every`` steps, every pair that fits at the
    end; each written as a row of metrics by ``write``. Ranks split the batches and sum."""

    kind = KIND
    context = "each target byte given its whole source and the target before it"

    def __init__(self, core: Seq2SeqLM, pairs: Sequence[Pair], batch: int, eval_tokens: int,
                 parallel: Parallelism, write: Callable[[dict], None]) -> None:
        self.core, self.pairs, self.batch, self.parallel, self.write = core, list(pairs), batch, parallel, write
        mean = sum(len(t) + 1 for _, t in pairs) / len(pairs)
        count = min(len(pairs), max(1, round(eval_tokens / mean)))
        step = len(pairs) / count
        self.sample = [self.pairs[int(i * step)] for i in range(count)]

    def estimate(self, step: int) -> float:
        """Mean NLL on the evenly spaced pairs; also checks that every rank holds the same routing centroids."""
        mean = self._mean(self.sample)
        in_sync = distributed.routing_in_sync(self.core, self.parallel.procs)
        if not in_sync:
            raise RuntimeError("routing centroids differ between ranks; this is a bug, please report it")
        self.write({"step": step, "split": "valid", "loss": mean, "value": metric(KIND, mean),
                    "routing_in_sync": in_sync})
        return mean

    def whole_split(self, step: int) -> float:
        """Mean NLL over every validation pair that fits."""
        mean = self._mean(self.pairs)
        self.write({"step": step, "split": "valid_full", "loss": mean, "value": metric(KIND, mean),
                    "context": self.context})
        return mean

    def _mean(self, pairs: list[Pair]) -> float:
        total, count = pair_nll(self.core, pairs, self.batch, self.parallel.procs, self.parallel.autocast)
        return total / max(count, 1)


@torch.no_grad()
def pair_nll(model: Seq2SeqLM, pairs: Sequence[Pair], batch: int, procs: distributed.Processes,
             autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> tuple[float, int]:
    """(sum of NLL in nats, target bytes scored, each target's end included) over ``pairs``, in batches of
    ``batch`` pairs of similar lengths, each rank taking every world-th batch, summed over ranks."""
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][1]), len(pairs[i][0])))
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for chosen in batches[procs.rank::procs.world]:
            tensors = pair_batch([pairs[i] for i in chosen]).to(procs.device)
            with autocast():
                logits = model(tensors.source, tensors.target_in, tensors.source_padding)
            total += float(F.cross_entropy(logits.float().flatten(0, 1), tensors.labels.flatten(),
                                           ignore_index=IGNORED, reduction="sum"))
            count += int((tensors.labels != IGNORED).sum())
    finally:
        model.train(was_training)
    total, count = distributed.sum_all([total, float(count)], procs)
    return total, int(count)


def train_seq2seq(run: Seq2SeqRun, run_dir: Path, procs: distributed.Processes, resume: bool,
                  echo: Callable[[str], object], say: Callable[[str], object] | None) -> Seq2SeqResult:
    """Train ``run`` in ``run_dir`` (see the module); called by ``trainer.train`` inside its processes. ``echo``:
    the run's lines; ``say``: the line naming the executor (both stacks and the cross heads share the decoder's)."""
    cfg = run.train
    started = time.monotonic()
    require_sacrebleu()  # before ten minutes of training, not after
    pairs = open_pairs(run)
    s = start_run(run, run_dir, procs, resume, pairs.data.meta, lambda: Seq2SeqLM(run.model))
    parallel, directory, core, optimizer, checkpointer, progress = (s.parallel, s.directory, s.core, s.optimizer,
                                                                    s.checkpointer, s.progress)
    num_params = s.num_params
    forward = TrainingForward(s.model, "off")  # eager: the batches change length every step
    directory.open_log(progress.step)
    batches = PairBatches(pairs.train, cfg.batch_size, seed=cfg.seed, share=(procs.rank, procs.world),
                          tokens=cfg.batch_tokens, parts=procs.world * cfg.grad_accum)
    batches.batch(progress.step + 1, 0, cfg.grad_accum)  # fail early on an impossible batch split
    if procs.main:
        m = run.model
        if say is not None:
            dtype = getattr(torch, resolve_precision(cfg.precision, procs.device))
            say(m.decoder.describe_executor(procs.device, dtype))
        echo(f"{'resuming' if resume else 'training'} {num_params / 1e6:.2f}M-parameter encoder-decoder model "
             f"(encoder {m.encoder.depth} layers, attention {m.encoder.attention}; decoder {m.decoder.depth} layers, "
             f"attention {m.decoder.attention}, cross {m.cross}; dim {m.decoder.dim}) on {cfg.data} "
             f"({len(pairs.train):,} training pairs of similar lengths, {batch_words(cfg)} a batch; "
             f"{pairs.left_out['train']:,} longer than {m.encoder.seq_len} / {m.decoder.seq_len - 1} bytes left out), "
             f"{parallel.describe()}; run directory {run_dir}")
        for warning in schedule_warnings(cfg):
            echo(f"warning: {warning}")
    try:
        micro = max(1, cfg.batch_size // (procs.world * cfg.grad_accum))
        validator = PairValidator(core, pairs.valid, 4 * micro, cfg.eval_tokens, parallel, directory.write)
        stop = StopRequest(echo if procs.main else None)
        loop = PairLoop(cfg, Parts(forward, core, optimizer, batches),
                        Services(parallel, directory, validator, checkpointer, stop), progress)
        stopped = run_loop(loop, resume)
        minutes = (time.monotonic() - started) / 60
        final_start = time.monotonic()
        valid = metric(KIND, validator.whole_split(progress.step))
        scores, sample = None, None
        if procs.main:
            translations = translate_all(core, [s for s, _ in pairs.valid_all], autocast=parallel.autocast)
            scores = score(translations, pairs.valid_all)
            directory.write({"step": progress.step, "split": "valid_translation", **vars(scores)})
            source = pairs.valid_all[len(pairs.valid_all) // 2][0]
            sample = (source.decode("utf-8", errors="replace"),
                      translations[len(pairs.valid_all) // 2].decode("utf-8", errors="replace"))
        plot = directory.plot("bits per byte")
        return Seq2SeqResult(run_dir, progress.step, stopped, "bits per target byte", valid, validator.context,
                             sample, plot, minutes, time.monotonic() - final_start, scores)
    finally:
        directory.close()


__all__ = ["PairLoop", "PairValidator", "PairsData", "open_pairs", "pair_nll", "split_pairs",
           "train_seq2seq"]
