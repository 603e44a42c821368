"""Learning-rate schedules: linear warm-up, then cosine decay to min_lr, 1/sqrt(step) decay, or constant."""

from __future__ import annotations

import math

from .config import TrainConfig


def learning_rate(step: int, train: TrainConfig) -> float:
    """The learning rate of optimiser step ``step`` (1-based): a function of the step alone, so resuming is exact."""
    warm = train.warmup_steps
    if warm and step <= warm:
        return train.lr * step / warm
    if train.schedule == "constant":
        return train.lr
    if train.schedule == "inverse_sqrt":  # the Transformer's schedule after warm-up
        return max(train.min_lr, train.lr * math.sqrt(max(warm, 1) / step))
    end = train.decay_steps or train.max_steps
    progress = min(1.0, (step - warm) / max(1, end - warm))
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))
