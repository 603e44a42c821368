"""Input validation shared by every attention function.

Every check raises ``ValueError`` naming the argument and the offending value: a wrong shape must never be
broadcast silently into a plausible-looking result.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def positive_int(name: str, value: object) -> int:
    """Return ``value`` as an int if it is a positive integer (bools rejected), else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, cross: bool = False) -> tuple[int, int, int, int]:
    """Check that q, k, v are floating (B, H, N, D) tensors of one shape, dtype and device; return (B, H, N, D).
    ``cross``: the keys and values are a memory of another length, k and v (B, H, Nk, D) (N is the queries')."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, N, D), got {t.dim()} dims with shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if cross:
        B, H, _, D = q.shape
        if v.shape != k.shape or (k.shape[0], k.shape[1], k.shape[3]) != (B, H, D):
            raise ValueError(
                f"cross-attention: k and v (the memory) must have shape (B, H, Nk, D) with q's B, H and D, got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if k.shape[2] == 0:
            raise ValueError(f"cross-attention: the memory must have Nk > 0 keys, got k {tuple(k.shape)}")
    elif k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k and v must have the same shape (B, H, N, D), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)} (a memory of another length: Inputs.cross)"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    B, H, N, D = q.shape
    if N == 0 or D == 0:
        raise ValueError(f"q, k and v must have N > 0 and D > 0, got shape {tuple(q.shape)}")
    return B, H, N, D


def check_scale(scale: float | None, head_dim: int) -> float:
    """Resolve ``scale=None`` to 1/sqrt(D); reject non-finite or non-positive scales."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    return float(scale)


def check_key_padding_mask(mask: Tensor | None, batch: int, n: int, device: torch.device) -> Tensor | None:
    """Check a (B, N) boolean key padding mask (True = keep)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise ValueError(f"key_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must be a bool tensor (True = keep), got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, n):
        raise ValueError(f"key_padding_mask must have shape (B, N) = {(batch, n)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"key_padding_mask is on {mask.device} but q is on {device}")
    return mask


def check_positions(name: str, positions: Sequence[int] | Tensor | None, n: int) -> list[int]:
    """Check a set of sequence positions in [0, n); return them sorted and deduplicated."""
    if positions is None:
        return []
    if isinstance(positions, Tensor):
        if positions.dim() != 1 or positions.is_floating_point() or positions.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a 1-D integer tensor of positions, got dtype {positions.dtype} "
                f"and shape {tuple(positions.shape)}"
            )
        values = [int(p) for p in positions.tolist()]
    else:
        values = []
        for p in positions:
            if isinstance(p, bool) or not isinstance(p, numbers.Integral):
                raise ValueError(f"{name} must hold integer positions, got {p!r}")
            values.append(int(p))
    bad = [p for p in values if not 0 <= p < n]
    if bad:
        raise ValueError(f"{name} holds positions out of range [0, {n}): {bad[:8]}")
    return sorted(set(values))


def check_per_head(name: str, value: int | Sequence[int] | Tensor, heads: int) -> list[int]:
    """Resolve an int or one positive int per head to a list of length ``heads``."""
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.is_floating_point():
            raise ValueError(f"{name} must be an int or a 1-D integer tensor with one value per head")
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != heads:
            raise ValueError(f"{name} must give one value per head ({heads}), got {len(value)}: {list(value)}")
        return [positive_int(f"{name}[{h}]", x) for h, x in enumerate(value)]
    return [positive_int(name, value)] * heads


def check_options(name: str, value: object, kind: type) -> Any:
    """``value`` when it is a ``kind`` (a mechanism's options dataclass, checked when it was made); otherwise a
    ValueError naming the argument and the type it needs."""
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be a {kind.__name__} (e.g. {kind.__name__}()), got {type(value).__name__}: "
                         f"{value!r}")
    return value


def check_split_heads(heads: int) -> int:
    """Heads split evenly between two patterns (merged=False) need an even head count; return heads // 2."""
    if heads % 2:
        raise ValueError(
            f"merged=False gives the first half of the heads one pattern and the second half the other, "
            f"so it needs an even number of heads, got H={heads}"
        )
    return heads // 2
