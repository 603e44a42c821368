"""The Sparse Transformer's GELU, x · sigmoid(1.702 x): the model's activation, here because a backend computes it.
Computed by the executor's ``activation_run`` where it has one and takes the call (the fused executor: one CPU
kernel each way, float32 and float64), else by PyTorch's expression (the same function, five elementwise passes):
with ``backend="tiles"`` a model runs no kernel of ours."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Executor


def sigmoid_gelu(x: Tensor, executor: Executor | None = None) -> Tensor:
    """x · sigmoid(1.702 x), elementwise, with its gradient, on ``executor`` (None: PyTorch's expression)."""
    if executor is not None:
        run = executor.runner(x).activation_run
        out = None if run is None else run(x)
        if out is not None:
            return out
    return x * torch.sigmoid(1.702 * x)
