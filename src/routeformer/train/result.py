"""What a finished run returns to its caller (the command line prints it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .translation import TranslationScores


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    stopped: str
    unit: str
    valid: float | None
    context: str  # how the whole split's windows were laid (``evaluation.context_policy``)
    sample: tuple[str, str] | None  # (prompt, continuation); an encoder-decoder run's: (source, its translation)
    plot: Path | None
    minutes: float  # from the start to the end of training
    final_seconds: float  # the whole-split evaluation and the sample


@dataclass
class Seq2SeqResult(TrainResult):
    """An encoder-decoder run's: also the validation split's translation scores."""

    scores: TranslationScores | None = None


__all__ = ["Seq2SeqResult", "TrainResult"]
