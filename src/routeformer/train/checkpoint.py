"""The run state: one atomically written file holding everything a resumed run needs."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from ..durable import atomic_write

CHECKPOINT = "checkpoint.pt"


def save_checkpoint(run_dir: Path, state: dict) -> None:
    """model, optimizer and scaler states, step, RNG states, best validation loss, … -> run_dir/checkpoint.pt.

    Written to a temporary file, fsynced and renamed: a run killed at any moment leaves the previous checkpoint.
    """
    atomic_write(run_dir / CHECKPOINT, lambda tmp: torch.save(state, tmp))


def load_checkpoint(run_dir: Path, device: torch.device | str = "cpu") -> dict:
    path = run_dir / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {run_dir} holds no checkpoint to resume from")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{path} cannot be read (truncated or corrupt?): {reason}") from None
