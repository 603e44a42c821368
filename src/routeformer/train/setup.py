"""What every run sets up before its loop, whichever model it trains: precision and parallelism, the run
directory (with its data's checksums), the model's seeded initial weights or a checkpoint's, its data-parallel
form, the optimizer and the checkpoint's state."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..data import DatasetMeta
from .checkpoint import Checkpointer, Progress, load_checkpoint, state_fits
from .distributed import Processes
from .loop import adamw
from .parallel import Parallelism
from .rundir import RunDirectory


@dataclass
class Started:
    """A run ready for its loop: ``core`` (the unwrapped model), ``model`` (its data-parallel form), the optimizer,
    the checkpointer, the progress restored (a fresh start's where not resuming), and ``num_params`` (counted
    before sharding, which leaves each rank a part)."""

    parallel: Parallelism
    directory: RunDirectory
    core: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    checkpointer: Checkpointer
    progress: Progress
    num_params: int


def start_run(run, run_dir: Path, procs: Processes, resume: bool, meta: DatasetMeta,
              build: Callable[[], nn.Module]) -> Started:
    """Set ``run`` (a ``RunConfig`` or ``Seq2SeqRun``) up in ``run_dir`` on data described by ``meta``, its model
    from ``build()`` (called after seeding: the same initial weights on every rank)."""
    cfg = run.train
    parallel = Parallelism(procs, cfg)  # a start whose precision or parallelism cannot be had leaves no directory
    directory = RunDirectory(run_dir, run, procs, resume)
    directory.prepare()
    directory.record_data(meta)
    state = load_checkpoint(run_dir) if resume else None
    torch.manual_seed(cfg.seed)
    core = build()
    num_params = sum(p.numel() for p in core.parameters() if p.requires_grad)
    if state is not None:
        with state_fits(run_dir):
            core.load_state_dict(state["model"])  # before sharding: the checkpoint holds the whole model
    core = core.to(procs.device)
    model = parallel.wrap(core)
    optimizer = adamw(core, cfg)
    checkpointer = Checkpointer(run_dir, run.model, parallel, core, optimizer)
    with state_fits(run_dir) if state is not None else contextlib.nullcontext():
        progress = checkpointer.restore(state)
    return Started(parallel, directory, core, model, optimizer, checkpointer, progress, num_params)


__all__ = ["Started", "start_run"]
