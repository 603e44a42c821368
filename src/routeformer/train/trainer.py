"""Training a run: data-parallel across torchrun processes, resumable exactly, stoppable at any moment.

:func:`train` puts the components together, in this order: the data (checked against the model), precision and
parallelism (parallel.py), the run directory (rundir.py, with the checksums of the data), the model (its seeded
initial weights, or a checkpoint's) in its data-parallel form, the optimizer and the checkpoint's state
(checkpoint.py), the metrics log, the batches, validation (evaluation.py), then the loop (loop.py) under the stop
signals (signals.py), and at the end the score on the whole validation split, the sample (sampling.py) and the
loss curve.

Every ``eval_every`` steps and at the end: validation loss, the run state (``checkpoint.pt``), the last weights
(``model.safetensors`` + ``config.json``) and, when the validation loss improves, the best weights (``best/``).
Ctrl-C (SIGINT) or SIGTERM: every rank stops at the same step boundary, the state is saved, and :class:`Interrupted`
is raised (the command line exits with status 130).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ..data import BatchSampler, DataError, Dataset, PackedRows, RepeatCurriculum
from ..model import TransformerLM
from . import distributed
from .config import RunConfig, TrainConfig
from .evaluation import UNITS, Validator, metric
from .loop import Loop, Parts, Services, run_loop, schedule_warnings
from .parallel import resolve_precision
from .result import Seq2SeqResult, TrainResult
from .rundir import new_run_dir
from .runs import check_sample_layout
from .sampling import decode, sample
from .seq2seq_config import Seq2SeqRun
from .seq2seq_trainer import train_seq2seq
from .setup import start_run
from .signals import Interrupted, StopRequest

__all__ = ["Interrupted", "TrainResult", "decode", "executor_line", "new_run_dir", "train"]


def train(run: RunConfig | Seq2SeqRun, run_dir: Path, *, resume: bool = False, echo=print,
          say=None) -> TrainResult | Seq2SeqResult:
    """Train ``run`` in ``run_dir`` (continuing its checkpoint when ``resume``). ``echo``: where the lines of the run
    go (the first, the validations, the warnings); ``say`` (None: nowhere): where the line naming the attention
    executor goes (``executor_line``), first, once the run is set up (the command line: stderr). Rank 0 only. An
    encoder-decoder run (``Seq2SeqRun``) trains on pairs (``seq2seq_trainer``)."""
    procs = distributed.start(run.train.device)
    try:
        if isinstance(run, Seq2SeqRun):
            return train_seq2seq(run, run_dir, procs, resume, echo, say)
        return _train(run, run_dir, procs, resume, echo, say)
    finally:
        distributed.stop(procs)


def executor_line(run: RunConfig, device: torch.device | None = None) -> str:
    """The line naming the executor training ``run`` runs its attention on and why (``describe_executor``), on
    ``device`` (default: the run's) in the run's precision."""
    dev = device or distributed.resolve_device(run.train.device)
    return run.model.describe_executor(dev, getattr(torch, resolve_precision(run.train.precision, dev)))


def _train(run: RunConfig, run_dir: Path, procs: distributed.Processes, resume: bool, echo, say) -> TrainResult:
    cfg = run.train
    started = time.monotonic()
    data = open_data(run)  # first: a start that fails on its data leaves no run directory behind
    kind = data.meta.kind
    s = start_run(run, run_dir, procs, resume, data.meta, lambda: TransformerLM(run.model))
    parallel, directory, core, optimizer, checkpointer, progress = (s.parallel, s.directory, s.core, s.optimizer,
                                                                    s.checkpointer, s.progress)
    model, num_params = s.model, s.num_params
    forward = parallel.training_forward(model, progress.compiled_from, progress.step + 1)  # last: it wraps model
    directory.open_log(progress.step)
    if cfg.short_steps and not (cfg.short_len < run.model.seq_len and run.model.seq_len % cfg.short_len == 0):
        raise DataError(f"short_len ({cfg.short_len}) must be shorter than seq_len ({run.model.seq_len}) and divide "
                        f"it: the length warm-up cuts each row into rows that long")
    repeats = RepeatCurriculum(cfg.repeat_steps, cfg.repeat_share) if cfg.repeat_steps else None
    if cfg.pack != "none":
        refusing = sorted({g.kind.name for layer in run.model.head_groups() for g in layer
                           if not g.kind.honours_documents(g.options)})
        if refusing:
            raise ValueError(f"pack = {cfg.pack!r}: {', '.join(refusing)} heads (with these options) do not honour "
                             f"packed documents yet (docs/attention.md, 'Packed documents'); set pack = \"none\"")
    starts = document_starts(data, cfg, "train")
    packed = None if cfg.pack != "documents" else PackedRows(data.split("train"), starts, run.model.seq_len + 1,
                                                             seed=cfg.seed)
    sampler = BatchSampler(data.split("train"), run.model.seq_len, cfg.batch_size, seed=cfg.seed,
                           share=(procs.rank, procs.world), align=data.meta.sample_length or 1, repeats=repeats,
                           documents=starts if packed is None else packed)
    sampler.batch(progress.step + 1, 0, cfg.grad_accum)  # fail early on an impossible batch split
    if procs.main:
        if say is not None:
            say(executor_line(run, procs.device))
            if parallel.compile_note:
                say(parallel.compile_note)
        sharded = " (sharded by FSDP2)" if parallel.sharded else ""
        m = run.model
        echo(f"{'resuming' if resume else 'training'} {num_params / 1e6:.2f}M-parameter model{sharded} "
             f"({m.depth} layers, dim {m.dim}, attention {m.attention}"
             f"{'' if m.token_shift == 'none' else f', token shift {m.token_shift}'}) on {cfg.data} ({UNITS[kind]}), "
             f"seq_len {m.seq_len}, batch {cfg.batch_size}{_repeats_note(cfg, packed)}, {parallel.describe()}; "
             f"run directory {run_dir}")
        for warning in schedule_warnings(cfg):
            echo(f"warning: {warning}")
    try:
        validator = Validator(core, data.split("valid"), kind, cfg, parallel, directory.write,
                              starts=document_starts(data, cfg, "valid"))
        stop = StopRequest(echo if procs.main else None)
        loop = Loop(cfg, Parts(forward, core, optimizer, sampler),
                    Services(parallel, directory, validator, checkpointer, stop), progress)
        stopped = run_loop(loop, resume)
        minutes = (time.monotonic() - started) / 60
        final_start = time.monotonic()
        valid = metric(kind, validator.whole_split(progress.step))
        text = sample(core, data, tokens=cfg.sample_tokens, seed=cfg.seed, device=procs.device,
                      autocast=parallel.autocast)
        plot = directory.plot(UNITS[kind])
        return TrainResult(run_dir, progress.step, stopped, UNITS[kind], valid, validator.context, text, plot,
                           minutes, time.monotonic() - final_start)
    finally:
        directory.close()


def document_starts(data: Dataset, cfg: TrainConfig, split: str) -> np.ndarray | None:
    """The split's document starts where the run keeps the boundaries (``TrainConfig.pack``), else None; a
    DataError naming what to do where the data set marks none."""
    if cfg.pack == "none":
        return None
    starts = data.starts(split)
    if starts is None:
        raise DataError(f"pack = {cfg.pack!r} needs the data set's document starts, and {cfg.data!r} was prepared "
                        f"without them (before they were recorded, or from a source that has none): prepare it "
                        f"again (`routeformer prepare {cfg.data}` after removing {data.directory}), or set "
                        f"pack = \"none\"")
    return starts


def _repeats_note(cfg: TrainConfig, packed: PackedRows | None) -> str:
    """The banner's mention of the length warm-up, the curriculum of repeated text and the documents' boundaries,
    where the run has them."""
    note = f", rows of {cfg.short_len} over the first {cfg.short_steps} steps" if cfg.short_steps else ""
    if cfg.pack == "boundaries":
        note += ", documents apart (no context across a file's boundary)"
    if packed is not None:
        note += (f", whole documents packed first-fit into {len(packed):,} rows ({packed.padding():.1%} padding; "
                 f"no context across a file's boundary)")
    if not cfg.repeat_steps:
        return note
    return note + f", {cfg.repeat_share:.0%} of rows repeated text over the first {cfg.repeat_steps} steps"


def open_data(run: RunConfig) -> Dataset:
    """The run's data set, checked against its model: vocabulary, splits longer than a window, sample layout."""
    data = Dataset.open(run.train.data, run.train.data_dir)
    meta, model = data.meta, run.model
    if model.vocab_size != meta.vocab_size:
        raise DataError(f"the model's vocab_size ({model.vocab_size}) does not match the vocabulary of data set "
                        f"{meta.name!r} ({meta.vocab_size}); set --set vocab_size={meta.vocab_size}")
    for split in ("train", "valid"):
        if meta.splits[split] < model.seq_len + 1:
            raise DataError(f"seq_len ({model.seq_len}) + 1 is longer than the {split} split of {meta.name!r} "
                            f"({meta.splits[split]} tokens); lower it with --set seq_len=...")
    check_sample_layout(model, meta)
    return data
