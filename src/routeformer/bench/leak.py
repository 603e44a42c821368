"""Causal leak of an attention function, measured: does any output at positions <= t change when everything after
t is replaced?

For ``attend(q, k, v)`` on (B, H, N, D) inputs, ``causal_leak`` computes the outputs once, then for each chosen t
replaces q, k and v at positions > t by fresh N(0, 1) draws and takes max |Δ out[..., :t+1, :]|. A causal attention
gives exactly 0 whenever its arithmetic for positions <= t never touches a later position (adding an exact 0 changes
no float); a value at float rounding (~1e-7 in float32) means later positions enter the arithmetic with zero weight
in a way that reorders sums; anything larger is a leak of the future into the past.

Every call runs under the same seeded global random state (``torch.random.fork_rng``), so an implementation that
draws random numbers inside the call (reformer-pytorch's hash rotations) draws the same ones in both calls: what
changes is only the input after t.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]

ROUNDING = 1e-5  # below this (float32 outputs of size ~1) a difference is reported as rounding, not as a leak


def leak_positions(n: int) -> list[int]:
    """The t probed at length n: the first position, one inside and one at the end of a power-of-two half, and the
    last position with a later one to replace."""
    return sorted({t for t in (0, n // 3, n // 2 - 1, n - 2) if 0 <= t < n - 1})


def causal_leak(attend: Attend, q: Tensor, k: Tensor, v: Tensor, positions: Sequence[int] | None = None, *,
                seed: int = 0) -> float:
    """max over t in ``positions`` (default ``leak_positions(N)``) of max |attend(q', k', v')[..., :t+1, :] -
    attend(q, k, v)[..., :t+1, :]|, where q', k', v' equal q, k, v at positions <= t and are fresh N(0, 1) draws
    (from a generator seeded by ``seed``) after t. 0.0 for a leak-free causal attention; NaN if an output is NaN."""
    n = q.shape[-2]
    positions = leak_positions(n) if positions is None else list(positions)
    gen = torch.Generator().manual_seed(seed + 1)
    base = _call(attend, q, k, v, seed)
    worst = []
    for t in positions:
        if not 0 <= t < n:
            raise ValueError(f"positions must lie in [0, {n}), got {t}")
        fresh = []
        for x in (q, k, v):
            x = x.detach().clone()
            tail = x[..., t + 1:, :]
            tail.copy_(torch.randn(tail.shape, generator=gen).to(tail))
            fresh.append(x)
        out = _call(attend, *fresh, seed)
        worst.append((out[..., :t + 1, :] - base[..., :t + 1, :]).abs().max())
    return float(torch.stack(worst).max()) if worst else 0.0


def _call(attend: Attend, q: Tensor, k: Tensor, v: Tensor, seed: int) -> Tensor:
    devices = [q.device] if q.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return attend(q, k, v).float()


def verdict(leak: float) -> str:
    if math.isnan(leak):
        return "NaN output"
    if leak == 0.0:
        return "none (exactly 0)"
    return "rounding" if leak < ROUNDING else "LEAKS"
