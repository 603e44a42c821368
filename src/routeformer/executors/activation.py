"""The Sparse Transformer's GELU, x · sigmoid(1.702 x): the model's activation, here because a backend computes it.
One fused CPU kernel each way where the fused kernels are built (float32 and float64 on the CPU), else PyTorch's
expression (the same function, five elementwise passes)."""

from __future__ import annotations

import torch
from torch import Tensor

from .fused.executor import takes
from .fused.op import sigmoid_gelu as fused


def sigmoid_gelu(x: Tensor) -> Tensor:
    """x · sigmoid(1.702 x), elementwise, with its gradient."""
    if takes(x):
        return fused(x)
    return x * torch.sigmoid(1.702 * x)
