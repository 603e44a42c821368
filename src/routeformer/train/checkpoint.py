"""Checkpointing: the run state in one atomically written file (``checkpoint.pt``) holding everything a resumed run
needs, and the weights beside it: the last (``model.safetensors`` + ``config.json``) and the best (``best/``)."""

from __future__ import annotations

import contextlib
import math
import pickle
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..durable import atomic_write
from ..model import TransformerConfig, TransformerLM
from ..model.pretrained import save_pretrained
from .distributed import Processes
from .parallel import Parallelism

CHECKPOINT = "checkpoint.pt"


def save_checkpoint(run_dir: Path, state: dict) -> None:
    """model, optimizer and scaler states, step, RNG states, best validation loss, … -> run_dir/checkpoint.pt.

    Written to a temporary file, fsynced and renamed: a run killed at any moment leaves the previous checkpoint.
    """
    atomic_write(run_dir / CHECKPOINT, lambda tmp: torch.save(state, tmp))


# What ``Checkpointer.save`` writes, besides "time_share" (absent in older checkpoints: 0).
STATE_KEYS = ("model", "optimizer", "scaler", "step", "best", "rng", "window")


def first_line(err: BaseException) -> str:
    """An exception's first line, or its type's name when it has no message: a one-line error's reason."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def load_checkpoint(run_dir: Path, device: torch.device | str = "cpu") -> dict:
    path = run_dir / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {run_dir} holds no checkpoint to resume from")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, IndexError,
            KeyError, TypeError, AttributeError) as err:  # random bytes reach the unpickler's own errors too
        raise ValueError(f"{path} cannot be read (truncated or corrupt?): {first_line(err)}") from None
    missing = [key for key in STATE_KEYS if not isinstance(state, dict) or key not in state]
    if missing or not isinstance(state["model"], dict) or not isinstance(state["rng"], list) or not state["rng"]:
        what = f"lacks {', '.join(missing)}" if missing else "holds a malformed model or rng entry"
        raise ValueError(f"{path} is not a run state (it {what}): corrupt, or not written by routeformer")
    return state



@contextlib.contextmanager
def state_fits(run_dir: Path) -> Iterator[None]:
    """A checkpoint whose content does not fit the run's model or optimiser: a one-line error naming it."""
    try:
        yield
    except (KeyError, TypeError, IndexError, RuntimeError, AttributeError) as err:
        raise ValueError(f"{run_dir / CHECKPOINT} does not fit this run's model or optimiser: {first_line(err)}") \
            from None


@dataclass
class Progress:
    """Where the run stands, beside its weights and optimizer: the last optimiser step taken, the best validation
    loss so far, the training loss summed since the last logged row (so a resumed run logs the same rows), and the
    share of the cosine decay the time budgets have used (``schedule.TimeShare``; a resumed run goes on from it), and
    the step from which training forwards ran compiled (None: eager so far; a resumed run compiles from its first step
    then, as the run did)."""

    step: int = 0
    best: float = math.inf
    window: dict = field(default_factory=lambda: {"loss": 0.0, "steps": 0})
    time_share: float = 0.0
    compiled_from: int | None = None

    @classmethod
    def of(cls, state: dict | None) -> Progress:
        """A checkpoint's progress, or a fresh start's (``state`` None)."""
        if state is None:
            return cls()
        compiled_from = state.get("compiled_from")
        return cls(int(state["step"]), float(state["best"]), dict(state["window"]), float(state.get("time_share", 0.0)),
                   None if compiled_from is None else int(compiled_from))


class Checkpointer:
    """Saves the run state and weights of ``core`` (the unwrapped model) and ``optimizer`` into ``run_dir``, and
    restores a checkpoint's state into them. Every rank calls every method (sharded states are gathered
    collectively); rank 0 writes."""

    def __init__(self, run_dir: Path, model_config: TransformerConfig, parallel: Parallelism, core: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        self.run_dir, self.model_config, self.parallel = run_dir, model_config, parallel
        self.core, self.optimizer = core, optimizer
        self.procs: Processes = parallel.procs
        self.progress = Progress()

    def restore(self, state: dict | None) -> Progress:
        """Optimizer and scaler states, progress and this rank's random-number generators from ``state`` (the
        model's weights were loaded before it was sharded); a fresh start's progress when ``state`` is None."""
        if state is not None:
            self.parallel.load_optimizer_state(self.core, self.optimizer, state["optimizer"])
            self.parallel.scaler.load_state_dict(state["scaler"])
        self.progress = Progress.of(state)
        if state is not None:
            rng = state["rng"][self.procs.rank % len(state["rng"])]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"], self.procs.device)
        return self.progress

    def save(self) -> None:
        """checkpoint.pt and the last weights, at the current step."""
        model_state, optim_state = self.parallel.full_state(self.core, self.optimizer)
        rng = {"cpu": torch.get_rng_state()}
        if self.procs.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.procs.device)
        rngs = [rng]
        if self.procs.distributed:
            rngs = [None] * self.procs.world
            dist.all_gather_object(rngs, rng)
        if self.procs.main:
            progress = self.progress
            save_checkpoint(self.run_dir, {
                "model": {k: v.detach().cpu() for k, v in model_state.items()}, "optimizer": optim_state,
                "scaler": self.parallel.scaler.state_dict(), "step": progress.step, "best": progress.best,
                "rng": rngs, "window": progress.window, "time_share": progress.time_share,
                "compiled_from": progress.compiled_from,
            })
        self.save_weights(self.run_dir, model_state)
        if self.procs.distributed:
            dist.barrier()

    def keep_if_best(self, loss: float) -> None:
        """The weights into best/ when validation ``loss`` is the lowest so far."""
        if loss < self.progress.best:
            self.progress.best = loss
            self.save_weights(self.run_dir / "best")

    def save_weights(self, directory: Path, model_state: dict | None = None) -> None:
        """model.safetensors + config.json in ``directory`` (rank 0). Sharded parameters are gathered first
        (every rank takes part) unless ``model_state`` already holds the full state."""
        sharded = self.parallel.sharded
        if sharded and model_state is None:
            model_state, _ = self.parallel.full_state(self.core, self.optimizer)
        if self.procs.main:
            if sharded:
                shadow = TransformerLM(self.model_config)
                shadow.load_state_dict(model_state)
                save_pretrained(shadow, directory)
            else:
                save_pretrained(self.core, directory)
