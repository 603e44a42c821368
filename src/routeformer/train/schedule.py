"""Learning-rate schedules: linear warm-up, then cosine decay to min_lr, 1/sqrt(step) decay, or constant.

The cosine decay follows the budget that binds: its share done at a step is the step's share of the decay steps or,
when a time budget (``max_minutes``) is set, the share of that budget used since the warm-up ended, whichever is
further (``TimeShare``). A run that its time budget stops before ``max_steps`` still reaches ``min_lr`` when it
stops; a run that reaches ``max_steps`` first follows its steps alone.
"""

from __future__ import annotations

import math

from .config import TrainConfig


def learning_rate(step: int, train: TrainConfig, time_share: float = 0.0) -> float:
    """The learning rate of optimiser step ``step`` (1-based). ``time_share``: the share of the cosine decay the time
    budget has used by this step (``TimeShare.at``; 0 without a time budget), so that without one the rate is a
    function of the step alone and resuming is exact."""
    warm = train.warmup_steps
    if warm and step <= warm:
        return train.lr * step / warm
    if train.schedule == "constant":
        return train.lr
    if train.schedule == "inverse_sqrt":  # the Transformer's schedule after warm-up
        return max(train.min_lr, train.lr * math.sqrt(max(warm, 1) / step))
    end = train.decay_steps or train.max_steps
    progress = max(min(1.0, (step - warm) / max(1, end - warm)), min(1.0, time_share))
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * progress))


class TimeShare:
    """The share of the cosine decay a time budget has used: 0 until the warm-up ends, then ``start`` (the share an
    earlier invocation used, from the checkpoint) plus the rest in proportion to the budget's seconds used since,
    reaching 1 when the budget runs out. Inactive (always 0) without a time budget, for schedules other than
    cosine, and when ``decay_steps`` plans the decay in steps explicitly."""

    def __init__(self, train: TrainConfig, budget_s: float, start: float = 0.0) -> None:
        self.active = self.applies(train, budget_s)
        self.warm, self.budget, self.start = train.warmup_steps, budget_s, min(1.0, max(0.0, start))
        self.began: float | None = None  # elapsed seconds when this invocation's first step after the warm-up began

    @staticmethod
    def applies(train: TrainConfig, budget_s: float) -> bool:
        """Whether the decay follows a time budget of ``budget_s`` seconds under ``train``."""
        return train.schedule == "cosine" and not train.decay_steps and math.isfinite(budget_s)

    def at(self, step: int, elapsed: float) -> float:
        """The share at optimiser step ``step`` (1-based), which begins ``elapsed`` seconds into the budget."""
        if not self.active or step <= self.warm:
            return 0.0
        if self.began is None:
            self.began = elapsed
        span = self.budget - self.began
        used = 1.0 if span <= 0 else min(1.0, (elapsed - self.began) / span)
        return self.start + (1.0 - self.start) * used
