"""Two values of the executor interface turned into others, for executors that do not read them natively
(``Executor.tiled`` applies them by what an executor ``supports``): a tiling's sequence order becomes one permuted
copy of q, k and v (and the results put back; the fused executor reads rows by index instead), and labelled pairs
(``KeyRestrictions.labels``) a tile mask (every executor; LSH on the fused one runs its rounds in one operator that
reads the labels itself)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from .inputs import Inputs
from .rows import RowKernel, inverse_order, move_rows
from .tiling import KeyRestrictions, Tiling


def in_order(tiled: Callable, inputs: Inputs, tiling: Tiling, **values) -> tuple[Tensor, Tensor | None]:
    """``tiled(inputs, tiling, **values)`` for a tiling with ``order``: q, k, v permuted (one copy each; k is q's
    copy when k is q), the tiling run on them without its order, out and lse put back in the original order."""
    ordered, inverse = to_order(inputs, tiling.order)
    out, lse = tiled(ordered, dataclasses.replace(tiling, order=None), **values)
    return from_order(out, lse, tiling.order, inverse)


def to_order(inputs: Inputs, order: Tensor, inverse: Tensor | None = None,
             kernel: RowKernel | None = None) -> tuple[Inputs, Tensor]:
    """(q[order], k[order], v[order] as inputs, the inverse permutation, made here unless given): one copy each, k
    q's copy when k is q, by a backend's row ``kernel`` where it has one (``rows.move_rows``); the key validity is
    left as it is (a call with an order gives it in that order already)."""
    q, k, v = inputs.q, inputs.k, inputs.v
    order = order.to(torch.long)
    if inverse is None:
        inverse = inverse_order(order)
    qs, vs = (move_rows(x, order, inverse, unreached=False, kernel=kernel) for x in (q, v))
    ks = qs if k is q else move_rows(k, order, inverse, unreached=False, kernel=kernel)
    return inputs.with_(q=qs, k=ks, v=vs), inverse


def from_order(out: Tensor, lse: Tensor | None, order: Tensor, inverse: Tensor,
               kernel: RowKernel | None = None) -> tuple[Tensor, Tensor | None]:
    """A call's out (B, H, N, D) and lse (B, H, N) or None, computed in ``order``, put back in the original order
    (by ``kernel`` as in ``to_order``)."""
    out = move_rows(out, inverse, order.to(torch.long), unreached=False, kernel=kernel)
    return out, None if lse is None else lse.gather(-1, inverse.expand(lse.shape))


def labels_as_mask(tiling: Tiling, restrict: KeyRestrictions) -> tuple[Tiling, KeyRestrictions]:
    """The pairs ``restrict.labels`` leave out as (the complement of) a tile mask, ANDed with the tiling's own."""
    held = tiling.label_mask(restrict.labels, restrict.label_window)
    mask = ~held if tiling.tile_mask is None else tiling.tile_mask & ~held
    return dataclasses.replace(tiling, tile_mask=mask), restrict._replace(labels=None, label_window=0)
