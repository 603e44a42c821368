"""Stopping a run on request: Ctrl-C (SIGINT) or SIGTERM asks the loop to stop at the end of the current step.

The loop folds the request into its one reduction a step, so every rank stops at the same step boundary; it then
saves the state and the trainer raises :class:`Interrupted` (the command line exits with status 130). A second
Ctrl-C aborts at once (KeyboardInterrupt), leaving the last checkpoint intact.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

from .checkpoint import CHECKPOINT


class Interrupted(Exception):
    """Training stopped on Ctrl-C / SIGTERM after saving its state."""

    def __init__(self, run_dir: Path, step: int) -> None:
        super().__init__(f"interrupted at step {step}; state saved in {run_dir / CHECKPOINT} (continue with "
                         f"`routeformer train --resume {run_dir}`)")
        self.run_dir, self.step = run_dir, step


class Diverged(RuntimeError):
    """The training loss was not finite at a step (on some rank): the weights after that step are not saved."""

    def __init__(self, run_dir: Path, step: int, loss: float, saved: int | None) -> None:
        kept = (f"{run_dir / CHECKPOINT} keeps step {saved}" if saved is not None else
                f"nothing was saved in {run_dir}")
        super().__init__(f"training diverged: the loss at step {step} is {loss} (lower lr, raise warmup_steps or "
                         f"clip, or train in float32); the weights after it are not saved: {kept}")
        self.run_dir, self.step, self.saved = run_dir, step, saved


class StopRequest:
    """Whether this process was asked to stop; ``echo`` (None on ranks other than 0) tells the user."""

    def __init__(self, echo: Callable[[str], object] | None) -> None:
        self.echo = echo
        self.requested = False

    @contextlib.contextmanager
    def handling(self) -> Iterator[StopRequest]:
        """SIGINT and SIGTERM set ``requested`` while the block runs; the previous handlers come back after it."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        if self.requested:  # a second Ctrl-C: stop now (the last checkpoint stays intact)
            raise KeyboardInterrupt
        self.requested = True
        if self.echo is not None:
            self.echo("\nstopping at the end of this step (Ctrl-C again to abort without saving)")
