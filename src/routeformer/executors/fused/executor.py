"""The fused CPU executor's runs (``interface.py`` registers them as the "fused" ``Executor``): ``tiled``
(``fused_tiled``), ``ranges`` (``fused_ranges``) and LSH's rounds (``fused_rounds``) as single C++ operators
(``csrc/``), each handed a call that ``Executor`` has delegated, laid out and checked once.

It takes the executor's values as they are (a ``Tiling`` and its sequence order, ``KeyRestrictions``,
``Distances``, key validity, relative tables, a bias) and computes the masks from them inside the kernel. The calls
it does not take (``takes``: tensors off the CPU, dtypes other than float32 and float64, and every call while its
library is unavailable, a warning having said why, once) its ``Executor`` delegates to the tiles executor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..inputs import Inputs, RelTerms
from ..ranges import KeyOrder, Ranges
from ..relative import RelativePositions
from ..tiling import HashRounds, KeyRestrictions, Tiling
from .build import KERNELS
from .geometry import BandGeometry, RangesGeometry, RoundsGeometry
from .op import BandFunction, RangesFunction, RoundsFunction, distinct, register

DTYPES = (torch.float32, torch.float64)


_LOADED: list[bool] = []  # [True] once the kernels are loaded: a process never unloads them


@torch.compiler.assume_constant_result  # decided once per process: a constant to torch.compile, not traced
def available() -> bool:
    """Whether the kernels are built and loaded (building them on first call; a warning says why not, once, or
    ``FusedKernelRequired`` under ``ROUTEFORMER_FUSED=1``)."""
    if KERNELS.load() is not None:
        return False
    register()
    if not _LOADED:
        _LOADED.append(True)
    return True


def built() -> bool:
    """Whether the kernels are loaded, building and loading them on the first call (``available``)."""
    return bool(_LOADED) or available()


def takes(q: Tensor) -> bool:
    """Whether the kernels take a call on queries q: on the CPU, float32 or float64, and built. Once they are
    loaded, every call asks only the device and dtype (the build's status is settled: no lock, no environment read
    per attention call). Asked once per call, by ``Executor.runner(q)`` (the fused executor's delegate): every
    ``*_run`` of this executor (``fused_route``, ``fused_select_blocks``, …) is reached through it and checks only
    its own other arguments."""
    return q.device.type == "cpu" and q.dtype in DTYPES and built()


def rows_per_block(width: int) -> int:
    """Query rows per kernel block for rows that see about ``width`` keys: a quarter of the width in multiples of
    8, 16 … 64 (a block's keys are the union of its rows' intervals, width + rows for a sliding window: larger blocks
    make larger products but pad more; measured at 16k, window 128: 32 rows 266 ms fwd+bwd, 64 rows 301)."""
    return max(16, min(64, 8 * -(-width // 32)))


def fused_tiled(inputs: Inputs, tiling: Tiling, *, restrict: KeyRestrictions | None = None,
                rel: RelTerms | None = None, bias: Tensor | None = None,
                need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """The fused executor's ``run``: a call of ``Executor.tiled`` (it documents the arguments), laid out and checked
    there, by the band operator: the tiling's sequence order read by index, its window's offsets, the restrictions'
    groups and own key, the relative tables with the pairs' distances (by unit, per tile entry, or between
    positions) and the bias, in one C++ call (``csrc/band.cpp``)."""
    q, k, v, scale, key_valid = inputs.q, inputs.k, inputs.v, inputs.scale, inputs.key_valid
    rel_pos, distances = (None, None) if rel is None else (rel.tables, rel.distances)
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    single = tiling.single(Nq)
    groups, exclude_self = (None, False) if restrict is None else (restrict.groups, restrict.exclude_self)
    # a sliding window goes to the kernel as itself (it derives the offsets); other offsets as offsets
    window = tiling.window
    offsets = None if window is not None else tiling.offsets
    lo, hi = offsets or (0, 0)
    unit, delta, positions, key_table, value_table, from_order = 0, None, None, None, None, False
    if rel_pos is not None:
        key_table, value_table = rel_pos.key.to(q.dtype), rel_pos.value.to(q.dtype)
        if distances.unit is not None:
            unit = distances.unit
        elif distances.delta is not None:
            delta = distances.delta.to(device=q.device, dtype=torch.long)
        elif distances.positions is tiling.order:  # the sorted window's: one tensor, passed once
            from_order = True
        else:
            positions = _indices(distances.positions, (B, H, Nk), "Distances.positions")
    reach = tiling.offsets
    width = (reach[1] - reach[0] + 1) if reach is not None else (Nk if single else tiling.span)
    geometry = BandGeometry(
        block=tiling.block, back=tiling.back, ahead=tiling.ahead, rows=tiling.rows or 0, single=single,
        has_offsets=offsets is not None, off_lo=lo, off_hi=hi, window=window.window if window else 0,
        causal=bool(window and window.causal), exclude_self=exclude_self, unit=unit,
        max_distance=0 if rel_pos is None else rel_pos.max_distance, rows_per_block=rows_per_block(width),
        positions_from_order=from_order)
    order = _indices(tiling.order, (B, H, Nk), "Tiling.order")
    out, lse, _ = BandFunction.apply(*distinct(
        _rows(q), _rows(k), _rows(v), geometry.ints(), float(scale),
        None if tiling.allow is None else tiling.allow.contiguous(), tiling.tile_mask, _valid(key_valid, B, H, Nk),
        _indices(groups, (B, H, Nk), "KeyRestrictions.groups"), order, key_table, value_table, delta,
        positions, None if bias is None else bias.to(q.dtype)))
    return out, (lse if need_lse else None)


def fused_ranges(inputs: Inputs, spans: Ranges, *, order: KeyOrder | None = None,
                 rel_pos: RelativePositions | None = None, need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """The fused executor's ``ranges_run``: a call of ``Executor.ranges`` (``ranges.range_attention`` documents the
    arguments), checked and broadcast there, by the ranges operator: every entry's range tested and its keys
    gathered by index inside the kernel, blocks of ``rows`` entries (default from merge · width) spanning at most
    width + ``stretch`` keys (default: ``rows``). The order's inverse is not needed: no permuted copy is made."""
    q, k, v, scale, key_valid = inputs.q, inputs.k, inputs.v, inputs.scale, inputs.key_valid
    lo, hi, width, merge, query_pos, key_pos, stretch, rows, documents = spans
    key_order = None if order is None else order.order
    # A row's merge entries each end at their own key, so a block of R entries spans about R / merge + width keys:
    # sized from merge · width, it pads its products as one entry of that width would, in half as many blocks as
    # when sized from the width alone (two probes of 64 at 16k: 32 entries against 16, the operator's forward +
    # backward 0.85x, docs/benchmarks.md).
    per_block = rows or rows_per_block(width * merge)
    key_table = value_table = None
    if rel_pos is not None:
        key_table, value_table = rel_pos.key.to(q.dtype), rel_pos.value.to(q.dtype)
    geometry = RangesGeometry(merge=merge, rows_per_block=per_block, span_cap=width + (stretch or per_block),
                              max_distance=0 if rel_pos is None else rel_pos.max_distance)
    B, H, Nq, _ = q.shape
    N, M = k.shape[2], lo.shape[-1]
    out, lse = RangesFunction.apply(*distinct(
        _rows(q), _rows(k), _rows(v), _indices(lo, (B, H, M), "Ranges.lo"), _indices(hi, (B, H, M), "Ranges.hi"),
        geometry.ints(), float(scale), _indices(key_order, (B, H, N), "KeyOrder.order"),
        _valid(key_valid, B, H, N), _indices(query_pos, (B, H, Nq), "Ranges.query_pos"),
        _indices(key_pos, (B, H, N), "Ranges.key_pos"), key_table, value_table,
        None if documents is None else documents.contiguous()))
    return out, (lse if need_lse else None)


def fused_rounds(q: Tensor, k: Tensor | None, v: Tensor, hashed: HashRounds, *, window: int, causal: bool,
                 scale: float, key_valid: Tensor | None = None) -> Tensor:
    """The fused executor's LSH rounds (``lsh.lsh_attention`` documents them): every round's sorted window read by
    index, the pairs earlier rounds hold left out, the rounds merged and the own key added inside the kernels. k
    None: the keys are scale · q / |q|, made inside the kernel (no keys tensor); else k's rows times ``scale``.
    ``hashed``: the rounds' sorted positions, buckets and labels (by position), each (B, H, R, N)."""
    geometry = RoundsGeometry(window=window, rows_per_block=rows_per_block(window), causal=causal)
    order, groups, labels = (x.to(torch.long).contiguous() for x in hashed)
    out, _, _ = RoundsFunction.apply(*distinct(_rows(q), None if k is None else _rows(k), _rows(v), order, groups,
                                               labels, None if key_valid is None else key_valid.contiguous(),
                                               geometry.ints(), float(scale)))
    return out


def _rows(x: Tensor) -> Tensor:
    """x with its last dimension contiguous and rows that do not overlap (the kernel hands rows to BLAS with the
    row stride as leading dimension; any other strides are fine)."""
    N, D = x.shape[-2:]
    if (x.stride(-1) == 1 or D <= 1) and (N == 0 or x.stride(-2) >= max(1, D)):
        return x
    return x.contiguous()


def _indices(x: Tensor | None, shape: tuple[int, int, int], name: str) -> Tensor | None:
    """x, one value per position of every (batch, head), broadcast to ``shape`` (B, H, N) as one contiguous long
    tensor (a batch or head dimension of 1 stands for all: the kernels index every head's own row); a ValueError
    naming it when it does not broadcast."""
    if x is None:
        return None
    if x.dim() != 3 or any(a not in (1, b) for a, b in zip(x.shape, shape, strict=True)):
        raise ValueError(f"{name} must be (B, H, N) = {shape} or broadcast to it (B or H of 1), got "
                         f"{tuple(x.shape)}")
    return x.expand(shape).to(torch.long).contiguous()


def _valid(key_valid: Tensor | None, B: int, H: int, N: int) -> Tensor | None:
    """Key validity (B, 1 or H, N) as the kernels read it: contiguous, a batch of 1 broadcast; a ValueError when it
    does not fit."""
    if key_valid is None:
        return None
    if key_valid.dim() != 3 or key_valid.shape[0] not in (1, B) or key_valid.shape[1] not in (1, H) \
            or key_valid.shape[2] != N:
        raise ValueError(f"key validity must be (B, 1 or H, N) = ({B}, 1 or {H}, {N}) or broadcast to it, got "
                         f"{tuple(key_valid.shape)}")
    return key_valid.expand(B, key_valid.shape[1], N).contiguous()
