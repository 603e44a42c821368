"""The fused operators at their boundary: valid calls recorded from the attention functions, one-argument mutations
of them, the operators' contract written out independently of the C++ checks (``violation``), and a worker that
runs mutated calls in a process of its own (a crash kills only it) and reports each one's outcome.

Used by ``test_fused_boundary.py``; also a script: ``python tests/fused_boundary.py enumerate [--dump FILE]`` runs
every recorded call × every mutation (``--ops band_forward,band_backward``: those operators' only), each in a process
of its own (forked from one worker), and prints the counts: the crashes of whatever build ``PYTHONPATH`` gives (an
older one too), and the outcomes the written contract disagrees with.

A mutation changes ONE argument: a dimension off by one (or to one, or zero), a batch of one, another dtype, a
non-contiguous or broadcast view, an index value out of range or repeated, an entry of an int list set to 0, -1 or
huge, a list one longer or shorter, a required tensor dropped to None, an optional one dropped or given. Each
outcome must be: an exception when ``violation`` says the mutated call breaks the contract; else a result, finite,
and equal to the unmutated call's when the mutation keeps its meaning (``same``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from routeformer.attention import FixedOptions, LocalOptions, LongformerOptions, LSHOptions
from routeformer.executors.fused.geometry import BandGeometry, RangesGeometry, RoundsGeometry

HERE = Path(__file__).resolve().parent
HUGE = 2**62
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
POSITION_LIMIT = 2**62  # positions beyond this could overflow their differences
OPS = ("band_forward", "band_backward", "ranges_forward", "ranges_backward", "rounds_forward", "rounds_backward",
       "sigmoid_gelu", "sigmoid_gelu_backward", "select_blocks", "route", "feature_scan_forward",
       "feature_scan_backward", "route_vectors", "route_vectors_backward", "probe_ranges")
INDEX_ARGS = {"order", "groups", "positions", "delta", "lo", "hi", "key_order", "query_pos", "key_pos", "labels",
              "key_clusters", "probes"}
MASK_ARGS = {"allow", "tile_mask", "key_valid", "alone"}
STRIDED5 = {"tile_mask", "delta", "bias"}  # read by strides, broadcast to (B, H, n_tiles, T, S)
# geometry fields that change the blocking alone (the results within rounding), by operator
SEMANTIC_FREE = {("band", "rows_per_block"), ("ranges", "rows_per_block"), ("ranges", "span_cap"),
                 ("rounds", "rows_per_block")}
GEOMETRIES = {"band": BandGeometry, "ranges": RangesGeometry, "rounds": RoundsGeometry}
# int arguments that change the blocking alone (the results within rounding) while they are at least 1
BLOCKING_INTS = {("feature_scan_forward", "chunk"), ("feature_scan_backward", "chunk")}


@dataclass
class Call:
    op: str
    args: list
    scenario: str


def names(op: str) -> list[str]:
    return [a.name for a in getattr(torch.ops.routeformer_fused, op).default._schema.arguments]


def optional(op: str, index: int) -> bool:
    return str(getattr(torch.ops.routeformer_fused, op).default._schema.arguments[index].type).startswith(
        "Optional")


# --- recording -----------------------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for ``torch.ops.routeformer_fused``: every call recorded (tensors detached and cloned), then run."""

    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls
        self.scenario = ""

    def __getattr__(self, name: str):
        real = getattr(torch.ops.routeformer_fused, name)

        def call(*args):
            kept = [a.detach().clone() if isinstance(a, Tensor) else (list(a) if isinstance(a, list) else a)
                    for a in args]
            self.calls.append(Call(name, kept, self.scenario))
            return real(*args)

        return call


@contextmanager
def recording(calls: list[Call]) -> Iterator[_Recorder]:
    from routeformer.executors.fused import op

    recorder = _Recorder(calls)
    real = op.ops
    op.ops = lambda: recorder
    try:
        yield recorder
    finally:
        op.ops = real


def _scenarios() -> Iterator[tuple[str, Callable[[], object]]]:
    """Small valid calls of every kind the attention functions make: (name, function returning what to
    differentiate)."""
    from helpers import rand_padding, rand_qkv, rand_rel, routing_layer
    from routeformer.attention import fixed_attention, local_attention, longformer_attention
    from routeformer.attention.lsh import lsh_attention
    from routeformer.executors import get_executor
    from routeformer.executors.fused import op
    from routeformer.executors.inputs import Inputs, RelTerms
    from routeformer.executors.ranges import KeyOrder, Ranges
    from routeformer.executors.tiling import Distances, KeyRestrictions, Tiling

    fused = get_executor("fused")
    B, H, N, D = 2, 2, 13, 4
    q, k, v = rand_qkv(B, H, N, D, seed=1)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    rel = rand_rel(D, 3)
    pad = rand_padding(B, N, seed=2)
    g = torch.Generator().manual_seed(5)
    yield "local causal, relative, padding", lambda: local_attention(Inputs.of(q, k, v, key_padding_mask=pad),
                                                                     LocalOptions(4), "fused", causal=True, rel=rel)
    yield "local non-causal, float32", lambda: local_attention(Inputs.of(q32, k32, v32), LocalOptions(3), "fused",
                                                               causal=False)
    yield "fixed (block diagonal, summary keys)", lambda: fixed_attention(Inputs.of(q, k, v), FixedOptions(4, 1),
                                                                          "fused")
    yield "longformer, global token, relative", lambda: longformer_attention(
        Inputs.of(q, k, v), LongformerOptions(window=3, dilation=1, global_tokens=[0]), "fused", rel=rel)
    routing = routing_layer(H, D, num_clusters=3, window=4, probes=1, backend="fused").double()
    yield "routing, sorted window", lambda: routing(q, q, v, rel)
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)
    hi = torch.randint(0, N + 1, (B, H, 2 * N), generator=g)
    lo = (hi - torch.randint(0, 5, (B, H, 2 * N), generator=g)).clamp_min(0)
    pos = torch.arange(N).expand(B, H, N)

    def ranges(documents=None):
        out, lse = fused.ranges(Inputs(q, k, v, 0.5, pad[:, None, :]),
                                Ranges(lo, hi, 4, 2, query_pos=pos, key_pos=pos, documents=documents),
                                order=KeyOrder(order, order), rel_pos=rel, need_lse=True)
        return out.sum() + lse.sum()

    yield "routing, probed ranges (merge 2, key order, relative, padding, lse)", ranges
    # the queries' documents only cut the kernel's blocks (any ids): these ranges need not lie within them
    yield "ranges with the queries' documents", lambda: ranges(torch.tensor([[0] * 5 + [3] * (N - 5), [1] * N]))
    yield "lsh causal, padding", lambda: lsh_attention(Inputs.of(q, q, v, key_padding_mask=pad),
                                                       LSHOptions(buckets=4, rounds=2, window=3), "fused")
    yield "lsh non-causal", lambda: lsh_attention(Inputs.of(q, q, v), LSHOptions(buckets=2, rounds=2, window=2),
                                                  "fused", causal=False)
    Nk, block, rows = 11, 4, 3
    mask = torch.rand(B, 1, 3, rows, 2 * block, generator=g) > 0.3
    delta = torch.randint(-4, 5, (1, H, 3, rows, 2 * block), generator=g)
    bias = torch.randn(B, H, 1, 1, 2 * block, generator=g, dtype=torch.float64)
    qr = torch.randn(B, H, 3 * rows, D, dtype=torch.float64, generator=g, requires_grad=True)
    kr, vr = (torch.randn(B, H, Nk, D, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))

    def tiled_rows():
        out, lse = fused.tiled(Inputs(qr, kr, vr, 0.7), Tiling(block=block, back=1, rows=rows, tile_mask=mask),
                               rel=RelTerms(rel, Distances(delta=delta)), bias=bias, need_lse=True)
        return out.sum() + lse.sum()

    yield "tiled: rows, tile mask, delta, bias, lse", tiled_rows
    groups = torch.randint(0, 3, (B, H, N), generator=g)
    allow = torch.rand(N, N, generator=g) > 0.2

    def tiled_dense():
        out, _ = fused.tiled(Inputs(q, k, v, 0.5, pad[:, None, :].expand(B, H, N)),
                             Tiling.dense(N, allow=allow, tile_mask=torch.rand(1, H, 1, N, N, generator=g) > 0.1),
                             restrict=KeyRestrictions(groups=groups, exclude_self=True),
                             rel=RelTerms(rel, Distances(positions=order)))
        return out

    yield "tiled: dense, allow, unsorted groups, own key, positions", tiled_dense
    x = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    yield "sigmoid_gelu", lambda: op.sigmoid_gelu(x)
    from routeformer.executors.fused.selection import fused_select_blocks

    for bound, top in ((True, 2), (False, 9)):  # 9: more picks than blocks

        def selection(bound=bound, top=top):
            chosen = fused_select_blocks(q.detach(), k.detach(), 3, top, bound)
            return q.sum() + chosen.sum()

        yield f"select_blocks: {'bound' if bound else 'mean'}, top {top}", selection

    def packed_selection():
        documents = torch.tensor([[0] * 4 + [1] * (N - 4)] * B)  # a document begins inside the second block
        return q.sum() + fused_select_blocks(q.detach(), k.detach(), 3, 2, True, documents).sum()

    yield "select_blocks: bound, top 2, packed documents", packed_selection
    from routeformer.executors.fused.routes import fused_route

    r = torch.nn.functional.normalize(q.detach(), dim=-1)
    centroids = torch.nn.functional.normalize(torch.randn(H, 5, D, dtype=q.dtype, generator=g), dim=-1)
    for probes, bias, observe in ((1, None, False), (2, torch.randn(H, 5, dtype=q.dtype, generator=g), True)):

        def route(probes=probes, bias=bias, observe=observe):
            got = fused_route(r, centroids, bias, pad, probes, observe)
            return q.sum() + got.probes.sum() + got.order.sum() + got.sums.sum()

        yield f"route: {probes} probes, {'a bias' if bias is not None else 'no bias'}, observed: {observe}", route
    from routeformer.executors.fused.probes import fused_probe_ranges

    clusters = torch.randint(0, 3, (B, H, N), generator=g)
    second = (clusters + torch.randint(1, 3, (B, H, N), generator=g)) % 3  # a query's second probe: another cluster

    def probe_ranges():
        lo, hi = fused_probe_ranges(clusters, torch.stack([clusters, second], -1), 4, True, True)
        return q.sum() + lo.sum() + hi.sum()

    yield "probe ranges: two probes, the own key left out unless alone", probe_ranges
    from routeformer.executors.fused.vectors import fused_routing_vectors

    turn = torch.linalg.qr(torch.randn(H, D, D, dtype=torch.float32, generator=g))[0]
    x = torch.randn(B, N, H, D, generator=g, requires_grad=True)  # read as the (B, H, N, D) view, rows strided
    yield "route vectors: float32, strided rows", lambda: fused_routing_vectors(x.transpose(1, 2), turn)
    from routeformer.attention import LinearOptions
    from routeformer.attention.linear import linear_attention
    from routeformer.attention.performer import orthogonal_features, performer_attention

    yield "feature scan: elu, padding, chunks of 4", lambda: linear_attention(
        Inputs.of(q, k, v, key_padding_mask=pad), LinearOptions("elu"), "fused", chunk=4)
    w = orthogonal_features(H, 6, D, generator=g)
    yield "feature scan: performer, float32, chunks of 5", lambda: performer_attention(
        Inputs.of(q32, k32, v32, scale=0.7), None, "fused", projection=w, chunk=5)
    from routeformer.documents import documents_from_lengths

    packed = documents_from_lengths([[3, N - 3]] * B)
    yield "feature scan: elu, packed documents, padding, chunks of 2", lambda: linear_attention(
        Inputs.of(q, k, v, key_padding_mask=pad, documents=packed), LinearOptions("elu"), "fused", chunk=2)


def record() -> list[Call]:
    """Every operator call (forward and backward) the scenarios make."""
    from routeformer.executors.fused import available

    assert available(), "the fused kernels are not built"
    calls: list[Call] = []
    with recording(calls) as rec:
        for name, run in _scenarios():
            rec.scenario = name
            out = run()
            torch.manual_seed(0)
            (out * torch.randn_like(out)).sum().backward()
    return calls


# --- the contract, written out --------------------------------------------------------------------------------------


class Violation(Exception):
    pass


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise Violation(what)


def _float(x, what: str, dtype: torch.dtype | None = None) -> None:
    _need(isinstance(x, Tensor), f"{what} is a tensor")
    _need(x.dtype in (torch.float32, torch.float64), f"{what} float32/64")
    _need(dtype is None or x.dtype == dtype, f"{what} of q's dtype")


def _rows_ok(x: Tensor, what: str) -> None:
    """q, k, v: 4-D, rows read in place (last dimension contiguous, rows not overlapping)."""
    _need(x.dim() == 4, f"{what} 4-D")
    _need(x.stride(3) == 1 or x.shape[3] <= 1, f"{what} last dimension contiguous")
    _need(x.shape[2] == 0 or x.stride(2) >= max(1, x.shape[3]), f"{what} rows do not overlap")


def _exact(x, shape: tuple, what: str, dtype: torch.dtype, contiguous: bool = True) -> None:
    _need(isinstance(x, Tensor), f"{what} is a tensor")
    _need(x.dtype == dtype, f"{what} dtype")
    _need(tuple(x.shape) == tuple(shape), f"{what} shape {tuple(shape)}")
    _need(not contiguous or x.is_contiguous(), f"{what} contiguous")


def _valid_mask(x, B: int, H: int, N: int) -> None:
    _need(isinstance(x, Tensor) and x.dtype == torch.bool and x.dim() == 3, "key_valid bool 3-D")
    _need(x.shape[0] == B and x.shape[1] in (1, H) and x.shape[2] == N and x.is_contiguous(), "key_valid shape")


def _broadcastable(x, shape: tuple, what: str, dtype: torch.dtype) -> None:
    _need(isinstance(x, Tensor) and x.dtype == dtype and x.dim() <= len(shape), f"{what} dtype")
    trailing = shape[len(shape) - x.dim():]
    _need(all(a in (1, b) for a, b in zip(x.shape, trailing, strict=True)), f"{what} broadcastable to {shape}")


def _permutations(x: Tensor, what: str) -> None:
    n = x.shape[-1]
    if x.numel() == 0:
        return
    rows = x.reshape(-1, n)
    _need(bool(((rows >= 0) & (rows < n)).all()), f"{what} in range")
    _need(bool((rows.sort(-1).values == torch.arange(n)).all()), f"{what} permutations")


def _positions(x: Tensor, what: str) -> None:
    _need(bool((x.abs() <= POSITION_LIMIT).all()) and bool((x != INT64_MIN).all()), f"{what} within 2^62")


def _geometry(x, cls) -> dict[str, int]:
    """An operator's int list by its fields' names (``fused/geometry.py``, checked against the C++ struct's)."""
    names = cls.names()
    _need(isinstance(x, list) and len(x) == len(names), f"geometry holds {len(names)} integers")
    return dict(zip(names, x, strict=True))


def _tables(key, value, K: int, D: int, dtype: torch.dtype) -> bool:
    _need((key is None) == (value is None), "key_table and value_table together")
    if key is None:
        return False
    _need(K >= 0 and 2 * K + 1 < 2**31, "max_distance")
    _exact(key, (2 * K + 1, D), "key_table", dtype)
    _exact(value, (2 * K + 1, D), "value_table", dtype)
    return True


def _qkv(q, k, v) -> tuple[int, int, int, int, int]:
    _float(q, "q")
    for x, what in ((q, "q"), (k, "k"), (v, "v")):
        _float(x, what, q.dtype)
        _rows_ok(x, what)
    B, H, Nq, D = q.shape
    _need(k.shape[0] == B and k.shape[1] == H and k.shape[3] == D, "k's B, H, D")
    _need(v.shape == k.shape, "v's shape")
    return B, H, Nq, k.shape[2], D


def _grads(grad_out, out, lse, grad_lse, B, H, Nq, D, dtype) -> None:
    _exact(grad_out, (B, H, Nq, D), "grad_out", dtype, contiguous=False)
    _exact(out, (B, H, Nq, D), "out", dtype, contiguous=False)
    _exact(lse, (B, H, Nq), "lse", dtype)
    if grad_lse is not None:
        _exact(grad_lse, (B, H, Nq), "grad_lse", dtype)


def _fits(*factors: int) -> bool:
    p = 1
    for f in factors:
        p *= f
    return -(2**63) <= p < 2**63


def _band(q, k, v, geometry, scale, allow, tile_mask, key_valid, groups, order, key_table, value_table, delta,
          positions, bias) -> tuple:
    B, H, Nq, Nk, D = _qkv(q, k, v)
    _need(math.isfinite(scale), "scale finite")
    g = _geometry(geometry, BandGeometry)
    block, back, ahead, rows, single, has_off, lo, hi, own, unit, K, rpb, from_order = (
        g["block"], g["back"], g["ahead"], g["rows"], g["single"], g["has_offsets"], g["off_lo"], g["off_hi"],
        g["exclude_self"], g["unit"], g["max_distance"], g["rows_per_block"], g["positions_from_order"])
    _need(block >= 1 and back >= 0 and ahead >= 0 and rows >= 0 and unit >= 0 and K >= 0 and rpb >= 1,
          "geometry ranges")
    _need(all(f in (0, 1) for f in (single, has_off, own, from_order)), "geometry flags")
    _need(not has_off or lo <= hi, "offsets")
    window, causal = g["window"], g["causal"]
    _need(window >= 0 and causal in (0, 1) and (window > 0 or not causal), "window")
    _need(window == 0 or not has_off, "a window and offsets")  # a window's offsets are derived from it
    _need(bool(single) == (back == 0 and ahead == 0 and block >= Nq and rows == 0), "single")
    if single:
        n_tiles, T, S = 1, Nq, Nk
    else:
        n_tiles = -(-(Nk if rows else Nq) // block)
        T = rows or block
        _need(_fits(n_tiles + back + ahead + 1, block), "geometry overflows")
        S = (back + 1 + ahead) * block
        _need(Nq == n_tiles * rows if rows else Nq == Nk, "banded tiles' queries")
    shape5 = (B, H, n_tiles, T, S)
    if allow is not None:
        _exact(allow, (T, S), "allow", torch.bool)
    if tile_mask is not None:
        _broadcastable(tile_mask, shape5, "tile_mask", torch.bool)
    if key_valid is not None:
        _valid_mask(key_valid, B, H, Nk)
    for x, what in ((groups, "groups"), (order, "order"), (positions, "positions")):
        if x is not None:
            _exact(x, (B, H, Nk), what, torch.long)
            _need(Nq == Nk, f"{what} need self-attention")
    if order is not None:
        _permutations(order, "order")
    if positions is not None:
        _positions(positions, "positions")
    _need(not own or Nq == Nk, "exclude_self needs self-attention")
    rel = _tables(key_table, value_table, K, D, q.dtype)
    if delta is not None:
        _broadcastable(delta, shape5, "delta", torch.long)
    sources = (unit > 0) + (delta is not None) + (positions is not None) + bool(from_order)
    _need(sources <= 1 and (not rel or sources == 1), "one source of distances with the tables")
    _need(not from_order or order is not None, "positions from the order need it")
    if bias is not None:
        _broadcastable(bias, shape5, "bias", q.dtype)
    return B, H, Nq, Nk, D, bool(own)


def _output_mask(x) -> None:
    _need(isinstance(x, list) and len(x) == 3 and all(isinstance(b, bool) for b in x), "output_mask: 3 bools")


def _band_backward(grad_out, grad_lse, q, k, v, out, lse, alone, *rest) -> None:
    *rest, mask = rest
    _output_mask(mask)
    B, H, Nq, Nk, D, own = _band(q, k, v, *rest)
    _grads(grad_out, out, lse, grad_lse, B, H, Nq, D, q.dtype)
    _need(isinstance(alone, Tensor) and alone.dtype == torch.bool, "alone bool")
    if own:
        _exact(alone, (B, H, Nq), "alone", torch.bool)


def _ranges(q, k, v, lo, hi, geometry, scale, key_order, key_valid, query_pos, key_pos, key_table,
            value_table, documents) -> tuple:
    B, H, Nq, N, D = _qkv(q, k, v)
    _need(math.isfinite(scale), "scale finite")
    g = _geometry(geometry, RangesGeometry)
    merge, rpb, cap, K = g["merge"], g["rows_per_block"], g["span_cap"], g["max_distance"]
    _need(merge >= 1 and rpb >= 1 and cap >= 1 and K >= 0, "geometry ranges")
    _need(_fits(Nq, merge), "merge overflows")
    M = Nq * merge
    _exact(lo, (B, H, M), "lo", torch.long)
    _exact(hi, (B, H, M), "hi", torch.long)
    _need(bool(((lo >= 0) & (lo <= hi) & (hi <= N)).all()), "0 <= lo <= hi <= N")
    if key_order is not None:
        _exact(key_order, (B, H, N), "key_order", torch.long)
        _permutations(key_order, "key_order")
    if key_valid is not None:
        _valid_mask(key_valid, B, H, N)
    for x, n, what in ((query_pos, Nq, "query_pos"), (key_pos, N, "key_pos")):
        if x is not None:
            _exact(x, (B, H, n), what, torch.long)
            _positions(x, what)
    if _tables(key_table, value_table, K, D, q.dtype):
        _need(query_pos is not None and key_pos is not None, "relative positions need positions")
    if documents is not None:  # any ids: where they change, the kernel's blocks end
        _exact(documents, (B, Nq), "documents", torch.long)
    return B, H, Nq, D


def _ranges_backward(grad_out, grad_lse, q, k, v, out, lse, *rest) -> None:
    *rest, mask = rest
    _output_mask(mask)
    B, H, Nq, D = _ranges(q, k, v, *rest)
    _grads(grad_out, out, lse, grad_lse, B, H, Nq, D, q.dtype)


def _rounds(q, k, v, order, groups, labels, key_valid, geometry, scale) -> tuple:
    _float(q, "q")
    _rows_ok(q, "q")
    for x, what in ((k, "k"), (v, "v")):
        if x is None and what == "k":
            continue
        _float(x, what, q.dtype)
        _rows_ok(x, what)
        _need(x.shape == q.shape, f"{what}'s shape")
    B, H, N, D = q.shape
    _need(math.isfinite(scale), "scale finite")
    g = _geometry(geometry, RoundsGeometry)
    window, rpb, causal = g["window"], g["rows_per_block"], g["causal"]
    _need(window >= 1 and rpb >= 1 and causal in (0, 1), "geometry ranges")
    _need(isinstance(order, Tensor) and order.dim() == 4 and order.shape[2] >= 1, "order (B, H, R, N)")
    shape = (B, H, order.shape[2], N)
    for x, what in ((order, "order"), (groups, "groups"), (labels, "labels")):
        _exact(x, shape, what, torch.long)
    _permutations(order, "order")
    _need(bool((groups[..., 1:] >= groups[..., :-1]).all()), "groups sorted")
    if key_valid is not None:
        _valid_mask(key_valid, B, H, N)
    return B, H, N, D


def _rounds_backward(grad_out, q, k, v, out, lse, alone, *rest) -> None:
    *rest, mask = rest
    _output_mask(mask)
    B, H, N, D = _rounds(q, k, v, *rest)
    _grads(grad_out, out, lse, None, B, H, N, D, q.dtype)
    _exact(alone, (B, H, N), "alone", torch.bool)


def _select(q, k, block, top, bound, documents) -> None:
    _float(q, "q")
    for x, what in ((q, "q"), (k, "k")):
        _float(x, what, q.dtype)
        _rows_ok(x, what)
    _need(k.shape == q.shape, "k's shape")
    _need(block >= 1 and top >= 1, "block, top >= 1")
    if documents is not None:  # any ids: a document is a run of equal ones
        _exact(documents, (q.shape[0], q.shape[2]), "documents", torch.long)


def _route(r, centroids, bias, key_valid, probes, observe) -> None:
    _float(r, "r")
    _rows_ok(r, "r")
    B, H, N, D = r.shape
    _float(centroids, "centroids", r.dtype)
    _need(centroids.dim() == 3 and centroids.shape[0] == H and centroids.shape[2] == D and centroids.shape[1] >= 1,
          "centroids (H, k >= 1, D)")
    _need(centroids.is_contiguous(), "centroids contiguous")
    k = centroids.shape[1]
    if bias is not None:
        _exact(bias, (H, k), "bias", r.dtype)
    if key_valid is not None:
        _valid_mask(key_valid, B, 1, N)
    _need(1 <= probes <= k, "1 <= probes <= k")


def _feature_scan(q, k, v, key_valid, projection, documents, chunk, scale) -> tuple:
    _float(q, "q")
    for x, what in ((q, "q"), (k, "k"), (v, "v")):
        _float(x, what, q.dtype)
        _need(x.dim() == 4, f"{what} 4-D")
        _exact(x, tuple(q.shape), what, q.dtype)
    B, H, N, D = q.shape
    if key_valid is not None:
        _valid_mask(key_valid, B, H, N)
    _need(chunk >= 1, "chunk >= 1")
    _need(math.isfinite(scale), "scale finite")
    if projection is not None:
        _need(isinstance(projection, Tensor) and projection.dim() == 3, "projection 3-D")
        _exact(projection, (H, projection.shape[1], D), "projection", q.dtype)
        _need(projection.shape[1] >= 1 and scale > 0, "m >= 1, scale > 0")
    if documents is not None:  # any ids: a document is a run of equal ones
        _exact(documents, (B, N), "documents", torch.long)
    return B, H, N, D


def _feature_scan_backward(grad_out, q, k, v, out, den, key_valid, projection, documents, chunk, scale) -> None:
    B, H, N, D = _feature_scan(q, k, v, key_valid, projection, documents, chunk, scale)
    _exact(grad_out, (B, H, N, D), "grad_out", q.dtype)
    _exact(out, (B, H, N, D), "out", q.dtype)
    _exact(den, (B, H, N), "den", q.dtype)


def _route_vectors(x, projection, eps) -> tuple:
    _float(x, "x")
    _rows_ok(x, "x")
    B, H, N, D = x.shape
    _exact(projection, (H, D, D), "projection", x.dtype)
    _need(math.isfinite(eps) and eps > 0, "eps positive and finite")
    return B, H, N, D


def _route_vectors_backward(grad_r, x, norm, projection, eps) -> None:
    B, H, N, D = _route_vectors(x, projection, eps)
    _exact(grad_r, (B, H, N, D), "grad_r", x.dtype)
    _exact(norm, (B, H, N), "norm", x.dtype)


def _probe_ranges(key_clusters, probes, window, exclude_self, own_when_alone) -> None:
    _need(isinstance(key_clusters, Tensor) and key_clusters.dim() == 3, "key_clusters (B, H, N)")
    B, H, N = key_clusters.shape
    _need(isinstance(probes, Tensor) and probes.dim() == 4 and probes.shape[3] >= 1, "probes (B, H, N, p >= 1)")
    _exact(key_clusters, (B, H, N), "key_clusters", torch.long)
    _exact(probes, (B, H, N, probes.shape[3]), "probes", torch.long)
    _need(window >= 1, "window >= 1")
    _need(exclude_self or not own_when_alone, "own_when_alone needs exclude_self")
    _need(bool(((key_clusters >= 0) & (key_clusters < 2**24)).all()), "key_clusters in [0, 2^24)")
    _need(bool((probes >= 0).all()), "probes >= 0")


def _gelu(x) -> None:
    _float(x, "x")


def _gelu_backward(grad, x) -> None:
    _float(x, "x")
    _exact(grad, tuple(x.shape), "grad", x.dtype, contiguous=False)


CONTRACTS = {"band_forward": _band, "band_backward": _band_backward, "ranges_forward": _ranges,
             "ranges_backward": _ranges_backward, "rounds_forward": _rounds, "rounds_backward": _rounds_backward,
             "sigmoid_gelu": _gelu, "sigmoid_gelu_backward": _gelu_backward, "select_blocks": _select,
             "route": _route, "feature_scan_forward": _feature_scan,
             "feature_scan_backward": _feature_scan_backward, "route_vectors": _route_vectors,
             "route_vectors_backward": _route_vectors_backward, "probe_ranges": _probe_ranges}


def violation(op: str, args: list) -> str | None:
    """What the call breaks of the operator's contract, or None."""
    if any(a is None and not optional(op, i) for i, a in enumerate(args)):
        return "a required tensor is None"
    try:
        CONTRACTS[op](*args)
    except Violation as v:
        return str(v)
    return None


# --- mutations -------------------------------------------------------------------------------------------------------


def _kind(call: Call, i: int) -> str:
    name = names(call.op)[i]
    x = call.args[i]
    if name == "output_mask":
        return "bools"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, list):
        return "ints"
    if isinstance(x, float):
        return "float"
    if name in INDEX_ARGS:
        return "index"
    if name in MASK_ARGS:
        return "mask"
    return "tensor"


def mutations(call: Call) -> list[dict]:
    """Every mutation of one call, as JSON-able specs (argument index ``arg``, ``kind``, parameters)."""
    out: list[dict] = []
    for i, x in enumerate(call.args):
        kind = _kind(call, i)
        if x is None:
            if optional(call.op, i):
                out.append(dict(arg=i, kind="give"))
            continue
        if kind == "bools":  # which gradients to compute: any choice is valid, a list of another length is not
            out += [dict(arg=i, kind="flip", at=e) for e in range(len(x))]
            out += [dict(arg=i, kind="length", by=1), dict(arg=i, kind="length", by=-1)]
            continue
        if kind == "bool":
            out.append(dict(arg=i, kind="toggle"))
            continue
        if kind == "int":
            out += [dict(arg=i, kind="int", value=v) for v in (0, -1, 1, x + 1, HUGE, INT64_MIN, INT64_MAX)]
            continue
        if kind == "ints":
            for e in range(len(x)):
                for value in (0, -1, 1, x[e] + 1, HUGE, INT64_MIN, INT64_MAX):
                    out.append(dict(arg=i, kind="entry", at=e, value=value))
            out += [dict(arg=i, kind="length", by=1), dict(arg=i, kind="length", by=-1)]
            continue
        if kind == "float":
            out += [dict(arg=i, kind="scale", value=v) for v in ("nan", "inf", -1.0, 0.0)]
            continue
        out.append(dict(arg=i, kind="none"))
        for d in range(x.dim()):
            for to in ("+1", "-1", "1", "0"):
                out.append(dict(arg=i, kind="dim", dim=d, to=to))
        out += [dict(arg=i, kind="rank", by=1), dict(arg=i, kind="rank", by=-1)]
        if x.dim() and x.shape[0] > 1:
            out += [dict(arg=i, kind="batch_of_one"), dict(arg=i, kind="batch_broadcast")]
        for dtype in ("float32", "float64", "int64", "int32", "bool", "float16"):
            if str(x.dtype) != f"torch.{dtype}":
                out.append(dict(arg=i, kind="dtype", dtype=dtype))
        out += [dict(arg=i, kind="strided"), dict(arg=i, kind="padded_rows")]
        if kind == "index" and x.numel():
            n = _extent(call, i)
            for value in (-1, n, n + 1, HUGE, INT64_MIN, INT64_MAX):
                for at in ("first", "last"):
                    out.append(dict(arg=i, kind="value", at=at, value=value))
            out.append(dict(arg=i, kind="repeat"))
    return out


def _extent(call: Call, i: int) -> int:
    """The length of the sequence an index tensor's values point into: k's for the ranges' ends, else the index's
    own last dimension."""
    if names(call.op)[i] in ("lo", "hi"):
        return _arg(call, "k").shape[2]
    return call.args[i].shape[-1]


def _arg(call: Call, name: str):
    return call.args[names(call.op).index(name)]


def _resized(x: Tensor, dim: int, size: int, g: torch.Generator) -> Tensor:
    """x with dimension ``dim`` of ``size``: cut, or grown by repeating its last slice (index values stay
    plausible), or fresh random values for float tensors."""
    shape = list(x.shape)
    shape[dim] = size
    if x.is_floating_point():
        return torch.randn(shape, generator=g, dtype=x.dtype)
    if size <= x.shape[dim]:
        return x.narrow(dim, 0, size).contiguous()
    if x.shape[dim] == 0:
        return torch.zeros(shape, dtype=x.dtype)
    extra = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x] + [extra] * (size - x.shape[dim]), dim)


def _given(call: Call, i: int) -> Tensor | None:
    """A harmless value for an optional argument the call leaves out (the same meaning where one exists)."""
    name = names(call.op)[i]
    if call.op == "route":  # r (B, H, N, D), centroids (H, k, D)
        r, centroids = _arg(call, "r"), _arg(call, "centroids")
        if name == "bias":
            return torch.zeros(centroids.shape[:2], dtype=r.dtype)
        return torch.ones(r.shape[0], 1, r.shape[2], dtype=torch.bool) if name == "key_valid" else None
    q = _arg(call, "q")
    B, H, Nq = q.shape[:3]
    if name == "documents":  # one document a row
        return torch.zeros(B, Nq, dtype=torch.long)
    N = _arg(call, "v").shape[2]
    if name == "key_valid":
        return torch.ones(B, 1, N, dtype=torch.bool)
    if name == "grad_lse":
        return torch.zeros(B, H, Nq, dtype=q.dtype)
    if name in ("groups", "query_pos"):
        return torch.zeros(B, H, Nq, dtype=torch.long)
    if name in ("key_pos", "positions"):
        return torch.arange(N).expand(B, H, N).contiguous()
    if name in ("order", "key_order"):
        return torch.arange(N).expand(B, H, N).contiguous()
    if name in ("tile_mask",):
        return torch.ones(1, 1, 1, 1, 1, dtype=torch.bool)
    if name == "bias":
        return torch.zeros(1, 1, 1, 1, 1, dtype=q.dtype)
    if name == "delta":
        return torch.zeros(1, 1, 1, 1, 1, dtype=torch.long)
    if name == "projection":
        return torch.randn(H, 3, q.shape[3], dtype=q.dtype, generator=torch.Generator().manual_seed(3))
    if name in ("key_table", "value_table"):
        return torch.randn(3, q.shape[3], dtype=q.dtype)
    if name == "k":
        return q.clone()
    if name == "allow":
        return torch.ones(1, 1, dtype=torch.bool)
    return None


def apply(call: Call, spec: dict) -> tuple[list, bool]:
    """(the mutated arguments, whether the mutation keeps the call's meaning)."""
    g = torch.Generator().manual_seed(7)
    args = list(call.args)
    i, kind = spec["arg"], spec["kind"]
    x = args[i]
    same = False
    dtypes = {"float32": torch.float32, "float64": torch.float64, "int64": torch.long, "int32": torch.int32,
              "bool": torch.bool, "float16": torch.float16}
    if kind == "give":
        args[i] = _given(call, i)
        same = names(call.op)[i] in ("key_valid", "grad_lse", "tile_mask", "bias", "order", "key_order", "groups",
                                     "query_pos", "key_pos", "positions", "delta", "documents")
    elif kind == "entry":
        x = list(x)
        old = x[spec["at"]]
        x[spec["at"]] = spec["value"]
        args[i] = x
        kind = call.op.split("_")[0]
        field = GEOMETRIES[kind].names()[spec["at"]] if kind in GEOMETRIES else None
        same = (kind, field) in SEMANTIC_FREE or old == spec["value"]
    elif kind == "toggle":
        args[i] = not x
    elif kind == "int":
        args[i] = spec["value"]
        same = spec["value"] == x or ((call.op, names(call.op)[i]) in BLOCKING_INTS and spec["value"] >= 1)
    elif kind == "length":
        args[i] = list(x) + [0] if spec["by"] > 0 else list(x)[:-1]
    elif kind == "flip":
        args[i] = [not b if e == spec["at"] else b for e, b in enumerate(x)]
    elif kind == "scale":
        args[i] = float(spec["value"])
        same = args[i] == x
    elif kind == "none":
        args[i] = None
        same = call.op.startswith("ranges") and names(call.op)[i] == "documents"  # they only cut the blocks
    elif kind == "dim":
        d, to = spec["dim"], spec["to"]
        size = {"+1": x.shape[d] + 1, "-1": max(0, x.shape[d] - 1), "1": 1, "0": 0}[to]
        args[i] = _resized(x, d, size, g)
        same = size == x.shape[d] and not x.is_floating_point()
    elif kind == "rank":
        if spec["by"] > 0:
            args[i] = x[None]
        else:
            args[i] = x.flatten(0, 1) if x.dim() >= 2 else x.reshape(-1)[0] if x.numel() else x.new_zeros(())
    elif kind == "batch_of_one":
        args[i] = x[:1].clone()
    elif kind == "batch_broadcast":
        args[i] = x[:1].expand(x.shape)
        same = bool((x == x[:1]).all())
    elif kind == "dtype":
        args[i] = x.to(dtypes[spec["dtype"]])
    elif kind == "strided":  # the same values, every dimension strided
        big = torch.zeros([2 * s for s in x.shape], dtype=x.dtype)
        view = big[tuple(slice(None, None, 2) for _ in x.shape)]
        view.copy_(x)
        args[i], same = view, True
    elif kind == "padded_rows":  # the same values, rows (last dimension) apart by more than their length
        if x.dim():
            big = torch.zeros(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype)
            view = big[..., : x.shape[-1]]
            view.copy_(x)
            args[i] = view
        same = True
    elif kind == "value":
        y = x.clone().view(-1)
        at = spec["at"]
        y[0 if at == "first" else -1 if at == "last" else at % y.numel()] = spec["value"]
        args[i] = y.view(x.shape)
    elif kind == "repeat":  # one entry repeated: a permutation no more
        y = x.clone().view(-1)
        if y.numel() > 1:
            y[1] = y[0]
        args[i] = y.view(x.shape)
        same = y.numel() <= 1 or bool(x.view(-1)[1] == x.view(-1)[0])
    else:
        raise ValueError(kind)
    return args, same


# --- running them ------------------------------------------------------------------------------------------------


def _outputs(result) -> list[Tensor]:
    return [r for r in (result if isinstance(result, (tuple, list)) else [result]) if isinstance(r, Tensor)]


def _finite(results: list[Tensor]) -> bool:
    return all(bool(torch.isfinite(r).all()) for r in results if r.is_floating_point())


def _equal(a: list[Tensor], b: list[Tensor]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        tol = 1e-4 if x.dtype == torch.float32 else 1e-9
        if x.is_floating_point() and not torch.allclose(x, y, rtol=tol, atol=tol):
            return False
        if not x.is_floating_point() and not torch.equal(x, y):
            return False
    return True


def run_one(call: Call, spec: dict, baseline: list[Tensor]) -> dict:
    """The outcome of one mutated call: raised (and whether the contract says it must), or returned (finite, equal
    to the unmutated call's where the mutation keeps its meaning)."""
    args, same = apply(call, spec)
    broken = violation(call.op, args)
    try:
        result = getattr(torch.ops.routeformer_fused, call.op)(*args)
    except (RuntimeError, ValueError, IndexError, TypeError) as error:
        message = str(error).splitlines()[0][:300]
        ok = broken is not None
        return dict(outcome="raised", ok=ok, broken=broken, message=message)
    results = _outputs(result)
    if broken is not None:
        return dict(outcome="returned", ok=False, broken=broken, message="the call breaks the contract")
    if not _finite(results):
        # A backward handed another scale than its forward's recomputes exp(scale' · s - lse) against an lse of the
        # other scale: that may overflow (scale' = -10 with s = -9 gives e^90), as on every executor. Such a call has
        # no finite answer to promise; it must still raise or return without a crash.
        meaningless = spec["kind"] == "scale" and call.op.endswith("_backward") and not same
        return dict(outcome="returned", ok=meaningless, broken=None,
                    message="non-finite results" + (" (a backward's scale not its forward's)" if meaningless else ""))
    if same and not _equal(results, baseline):
        return dict(outcome="returned", ok=False, broken=None, message="differs from the unmutated call")
    return dict(outcome="returned", ok=True, broken=None, message="same" if same else "valid")


def _library() -> str:
    """The loaded kernels' file, where the build keeps it (a process that compiled them loaded them from the private
    folder they were built in, since moved): a worker loads it alone instead of importing routeformer (seconds per
    worker)."""
    from routeformer.executors.fused import executor

    status = executor.KERNELS.status()
    return str(status.library) if status.ok else ""


CHILD_SECONDS = 60  # a mutated call that runs longer is reported as hung


def _isolated(run: Callable[[], dict]) -> dict:
    """``run()`` in a forked child process: its outcome, or "crashed" when the child dies (a signal, an abort, a
    corrupted heap), so that each mutation is counted on its own and no corruption carries over to the next. The
    worker runs one thread: no OpenMP pool to inherit half-way."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the outcome down the pipe, then out without the parent's exit handlers
        os.close(read)
        signal.alarm(CHILD_SECONDS)
        try:
            text = json.dumps(run())
        except BaseException:  # noqa: BLE001 - reported, not raised
            text = json.dumps(dict(outcome="harness error", ok=False, message=traceback.format_exc(limit=3)[-600:]))
        os.write(write, text.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and chunks:
        return json.loads(b"".join(chunks))
    how = f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else \
        f"exit status {os.WEXITSTATUS(status)}"
    return dict(outcome="crashed", ok=False, message=f"the call killed its process ({how})")


def worker(calls_path: str, specs_path: str, library: str = "", isolate: str = "1") -> None:
    """Run the mutations ``specs`` (a JSON list of {"call": index, ...}) of the recorded calls, printing one JSON
    line when each starts and one with its outcome (flushed: a crash of the worker itself leaves the last start
    line). ``isolate``: each mutation in a forked child (``_isolated``), so a crash is one outcome, not the end."""
    if library:
        torch.ops.load_library(library)
    else:
        from routeformer.executors.fused import available

        assert available()
    torch.set_num_threads(1)
    calls = [Call(**c) for c in torch.load(calls_path, weights_only=False)]
    specs = json.loads(Path(specs_path).read_text())
    baselines: dict[int, list[Tensor]] = {}
    for n, spec in enumerate(specs):
        c = spec["call"]
        if c not in baselines:
            baselines[c] = _outputs(getattr(torch.ops.routeformer_fused, calls[c].op)(*calls[c].args))
        print(json.dumps(dict(n=n, start=True)), flush=True)

        def run(c=c, spec=spec) -> dict:
            try:
                return run_one(calls[c], spec, baselines[c])
            except Exception:  # noqa: BLE001 - a harness error is reported, not a crash
                return dict(outcome="harness error", ok=False, message=traceback.format_exc(limit=3)[-600:])

        outcome = _isolated(run) if isolate == "1" and hasattr(os, "fork") else run()
        print(json.dumps(dict(n=n, **outcome)), flush=True)


def save_calls(calls: list[Call], path: Path) -> None:
    torch.save([dict(op=c.op, args=c.args, scenario=c.scenario) for c in calls], path)


def run_batch(calls_path: Path, specs: list[dict], *, timeout: float = 600) -> dict:
    """Run ``specs`` in a worker process (each mutation in a child of its own): {"outcomes": {n: outcome},
    "crashes": [n whose call killed its process], "rc": the worker's return code, "stderr": its tail}. Should the
    worker itself die, a new one goes on after the mutation it was running."""
    outcomes: dict[int, dict] = {}
    todo = list(range(len(specs)))
    rc, err = 0, ""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    for attempt in range(len(specs) + 1):
        specs_path = calls_path.with_suffix(f".specs{attempt}.json")
        specs_path.write_text(json.dumps([specs[n] for n in todo]))
        proc = subprocess.run([sys.executable, str(Path(__file__)), "worker", str(calls_path), str(specs_path),
                               _library()], capture_output=True, text=True, timeout=timeout, env=env)
        rc, err = proc.returncode, proc.stderr[-3000:]
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                n = todo[rec.pop("n")]
                started = n if rec.pop("start", False) else None
                if started is None:
                    outcomes[n] = rec
        if rc == 0 or started is None:  # done, or died outside a mutation (at start): nothing more to learn
            break
        outcomes[started] = dict(outcome="crashed", ok=False, message=f"the worker died (return code {rc})")
        todo = [n for n in todo if n > started]
    crashes = [n for n, o in sorted(outcomes.items()) if o["outcome"] == "crashed"]
    return dict(outcomes=outcomes, crashes=crashes, rc=rc, stderr=err)


def enumerate_all(calls: list[Call]) -> list[dict]:
    return [dict(call=c, **m) for c, call in enumerate(calls) for m in mutations(call)]


def _main(argv: list[str]) -> int:
    if argv[0] == "worker":
        worker(*argv[1:])
        return 0
    if argv[0] == "enumerate":
        import tempfile

        sys.path.insert(0, str(HERE))
        calls = record()
        specs = enumerate_all(calls)
        if "--ops" in argv:  # only these operators' calls (a comma list), after a change to their kernels
            wanted = set(argv[argv.index("--ops") + 1].split(","))
            specs = [s for s in specs if calls[s["call"]].op in wanted]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "calls.pt"
            save_calls(calls, path)
            res = run_batch(path, specs, timeout=3600)
        outcomes = res["outcomes"]
        by_op: dict[str, dict[str, int]] = {}
        for n, spec in enumerate(specs):
            o = outcomes.get(n, dict(outcome="not run", ok=False))
            key = o["outcome"] if o["ok"] or o["outcome"] in ("crashed", "not run") else o["outcome"] + " (wrong)"
            op = calls[spec["call"]].op
            by_op.setdefault(op, {}).setdefault(key, 0)
            by_op[op][key] += 1
        print(f"{len(calls)} recorded calls, {len(specs)} mutations, {len(res['crashes'])} crashed")
        for op, counts in sorted(by_op.items()):
            print(f"  {op}: {dict(sorted(counts.items()))}")
        for n in res["crashes"]:
            c = calls[specs[n]["call"]]
            print(f"  crashed: {c.op} [{c.scenario}] {names(c.op)[specs[n]['arg']]} {specs[n]}: "
                  f"{outcomes[n]['message']}")
        wrong = [(n, o) for n, o in outcomes.items() if not o["ok"] and o["outcome"] != "crashed"]
        for n, o in wrong[:int(os.environ.get("SHOW_WRONG", "40"))]:
            c = calls[specs[n]["call"]]
            print(f"  wrong: {c.op} [{c.scenario}] {names(c.op)[specs[n]['arg']]} {specs[n]} -> {o}")
        print(f"  {len(wrong)} wrong outcomes")
        if "--dump" in argv:
            rows = [dict(op=calls[s["call"]].op, scenario=calls[s["call"]].scenario, name=names(calls[s["call"]].op)[
                s["arg"]], spec=s, **outcomes.get(n, {})) for n, s in enumerate(specs)]
            Path(argv[argv.index("--dump") + 1]).write_text(json.dumps(rows, indent=0))
        return 0 if not res["crashes"] and not wrong else 1
    raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
