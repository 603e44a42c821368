"""Moving rows of (B, H, N, D) tensors along N: sorting a sequence by cluster, laying entries out in tiles and back.

``gather_rows`` is a plain gather (its gradient an index_add into zeros). ``move_rows`` is for maps that are one to
one: its gradient is a gather too, by the map back, with no zero-filled buffer and no scatter-add.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# A backend's row mover: (x (B, H, N, D), index (B, H, M), scale) -> x[..., min(index, N - 1), :] · scale, or None
# where it does not take x (the flex executor's Triton kernel on CUDA, ``flex.rows.moved``)
RowKernel = Callable[[Tensor, Tensor, float], "Tensor | None"]


def inverse_order(order: Tensor) -> Tensor:
    """The inverse of the permutations ``order`` (..., N) along the last dim: inverse[..., order[..., j]] = j."""
    n = order.shape[-1]
    return torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=order.device).expand_as(order))


def gather_rows(x: Tensor, index: Tensor, kernel: RowKernel | None = None) -> Tensor:
    """Rows of x (B, H, N, D) picked per (B, H) by index (B, H, M) in [0, N) -> (B, H, M, D): one index_select over
    the flattened rows (its gradient an index_add), or a backend's row ``kernel`` where it takes x (``move_rows``'
    kinds; no gradient: for a backward, or a forward inside an autograd Function, where none is recorded)."""
    if kernel is not None:
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError("gather_rows: a row kernel records no gradient; call it where autograd records none "
                             "(an autograd Function's forward or backward)")
        out = kernel(x, index, 1.0)
        if out is not None:
            return out
    B, H, N, D = x.shape
    base = torch.arange(B * H, device=x.device).view(B, H, 1) * N
    return x.reshape(B * H * N, D).index_select(0, (index + base).reshape(-1)).view(B, H, -1, D)


def rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_d a[..., d] · b[..., d] for a, b (..., D) -> (...): batched (1, D)·(D, 1) matmuls, several times faster on
    CPU than (a * b).sum(-1), which writes the product out first."""
    D = a.shape[-1]
    return torch.bmm(a.reshape(-1, 1, D), b.reshape(-1, D, 1)).view(a.shape[:-1])


def _moved(x: Tensor, index: Tensor, scale: float, kernel: RowKernel | None) -> Tensor:
    """x[..., min(index, N - 1), :] · scale for x (B, H, N, D), index (B, H, M): a backend's ``kernel`` where it
    takes x (the flex executor's on CUDA: ``flex.rows.moved``), else an index_select and an in-place scale."""
    out = None if kernel is None else kernel(x, index, scale)
    if out is not None:
        return out
    out = gather_rows(x, index.clamp_max(x.shape[2] - 1))
    return out if scale == 1.0 else out.mul_(scale)


class _Move(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, back: Tensor, unreached: bool,  # type: ignore[override]
                scale: float, kernel: RowKernel | None) -> Tensor:
        ctx.save_for_backward(back)
        ctx.m, ctx.unreached, ctx.scale, ctx.kernel = index.shape[-1], unreached, scale, kernel
        return _moved(x, index, scale, kernel)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (back,) = ctx.saved_tensors
        out = _moved(grad, back, ctx.scale, ctx.kernel)
        if ctx.unreached:
            out = out.masked_fill_((back >= ctx.m)[..., None], 0.0)
        return out, None, None, None, None, None


def move_rows(x: Tensor, index: Tensor, back: Tensor, *, unreached: bool = True, scale: float = 1.0,
              kernel: RowKernel | None = None) -> Tensor:
    """out[..., j, :] = x[..., index[j], :] for x (B, H, N, D) and index (B, H, M); ``back`` (B, H, N) is the map the
    other way, back[index[j]] = j, and carries the gradient: grad_x[i] = grad_out[back[i]].

    For one-to-one maps: a permutation (``back`` its inverse), or rows laid out in slots with holes. An index of N
    marks a hole of the output (its row holds some row of x, which the caller must mask: the hole's gradient reaches
    nothing), and a ``back`` of M a row of x that reaches no output (its gradient is zero; ``unreached=False``
    declares there is none, as for a permutation, and saves that pass). Time and memory O(M · D) forward,
    O(N · D) backward. ``scale``: the moved rows come out multiplied by it (in place on the fresh copy, both ways:
    no (B, H, N, D) pass of its own). ``kernel``: a backend's own mover, (x, index, scale) -> the moved rows, or
    None where it does not take x (then PyTorch's index_select), both ways.
    """
    return _Move.apply(x, index, back, unreached, scale, kernel)
