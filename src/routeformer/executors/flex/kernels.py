"""The flex executor's Triton kernels (``router.py`` and ``selection.py`` launch them): imported only where Triton is
(CUDA builds of PyTorch carry it; ``pip install routeformer[triton]`` on a CPU, where ``TRITON_INTERPRET=1`` runs
them on CPU tensors for the tests).

- ``choose``: each position's ``P`` best clusters by cosine + bias, never writing the (N, k) scores: a block of
  rows against the centroids a chunk of clusters at a time, a running best per row, ``P`` passes (a pass leaves
  out the clusters the earlier ones chose); the best cluster's cosine (without the bias) for the commitment term;
  the clusters' sizes counted with integer atomics (exact whatever their order).
- ``reduce``: the k-means statistics as a segmented reduction over the sorted order, one program per (cluster,
  head) summing its run of every batch entry in a fixed order: the same bits at every launch (no float atomics).
- ``select``: MoBA's block selection: each query's ``TOP`` best complete blocks before its own by a score that
  is a product of the query's and the block's summary vectors, never writing the (N, N / block) scores.
- ``move``: rows of a (B, H, N, D) tensor of any strides moved along N by an index (sorting a sequence by
  cluster and back), scaled on the way.

On a GPU the scores are float32 dot products on the tensor cores in three TF32 passes (``tf32x3``: the operands
split into a high and a low TF32 part, float32's accuracy to ~1e-6); ``choose``'s tiles are tuned once per (k, D,
probes) by Triton's autotuner. Under the interpreter (CPU tensors) every dot is exact float32 and one tile is used.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# the scores' dot products: three TF32 passes on a GPU's tensor cores (float32 on its CUDA cores is ~10x slower:
# 2.4 ms of a 8.4 ms routing step at N = 65,536, k = 256 on an H200, docs/gpu.md); exact under the interpreter
DOT_PRECISION = tl.constexpr("ieee" if INTERPRETED else "tf32x3")
# choose's tiles (rows, clusters, warps): the autotuner times those that fit k once per (k, D, probes) on the GPU
CHOOSE_TILES = [(64, 32, 4)] if INTERPRETED else [(64, 32, 4), (64, 64, 4), (128, 64, 8), (64, 128, 4),
                                                   (128, 128, 8), (128, 32, 4)]


def next_pow2(n: int) -> int:
    """The least power of two >= n (Triton's block shapes are powers of two)."""
    return 1 << max(0, (n - 1).bit_length())


def block_dim(d: int) -> int:
    """The block of a row's d features: a power of two, at least 16 (``tl.dot``'s least)."""
    return max(16, next_pow2(d))


@triton.jit
def _better(s, cols, k0, chosen, best, arg, EXCLUDE: tl.constexpr):
    """A chunk's scores s (BLOCK_N, BLOCK_K) of columns ``cols`` (k0 ...) merged into each row's running best
    (``best``, ``arg``): the chunk's argmax (ties to the lower column) where it beats the best so far (ties keep
    the earlier chunk); ``EXCLUDE``: the columns ``chosen`` (BLOCK_N, P_PAD) holds are left out (earlier passes'
    picks)."""
    if EXCLUDE:
        taken = tl.max((cols[None, :, None] == chosen[:, None, :]).to(tl.int32), axis=2) > 0
        s = tl.where(taken, float("-inf"), s)
    m = tl.max(s, axis=1)
    a = tl.argmax(s, axis=1, tie_break_left=True).to(tl.int32) + k0
    better = m > best
    return tl.where(better, m, best), tl.where(better, a, arg)


def _fitting(configs: list, named_args: dict, **kwargs) -> list:
    """The tiles worth timing for ``K`` clusters: none wider in clusters than the next power of two of K (at least
    32), so that a small k times two tiles, not six."""
    widest = max(32, next_pow2(named_args["K"]))
    return [c for c in configs if c.kwargs["BLOCK_K"] <= widest]


@triton.autotune([triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in CHOOSE_TILES],
                 key=["K", "D", "P"], prune_configs_by={"early_config_prune": _fitting},
                 reset_to_zero=["COUNTS"])  # timing runs add to COUNTS: zeroed after them
@triton.jit
def choose(R, C, BIAS, PROBES, COSINE, COUNTS, N, H, K, D,
           HAS_BIAS: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """R (B·H, N, D) unit routing vectors, C (H, K, D) centroids, BIAS (H, K) -> PROBES (B·H, N, P) int64 best
    first (ties to the lower index, as argmax), COSINE (B·H, N) float32 the best cluster's cosine, COUNTS (B·H, K)
    int32 += the rows whose best cluster each is. Grid (cdiv(N, BLOCK_N), B·H)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    h = bh % H
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < N
    d = tl.arange(0, BLOCK_D)
    x = tl.load(R + (bh * N + rows[:, None]) * D + d[None, :], mask=in_rows[:, None] & (d[None, :] < D), other=0.0)
    chosen = tl.full((BLOCK_N, P_PAD), -1, tl.int32)
    slots = tl.arange(0, P_PAD)
    first_best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    first_arg = tl.zeros((BLOCK_N,), tl.int32)
    for t in tl.static_range(P):
        best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        arg = tl.zeros((BLOCK_N,), tl.int32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            in_cols = cols < K
            c = tl.load(C + (h * K + cols[None, :]) * D + d[:, None], mask=(d[:, None] < D) & in_cols[None, :],
                        other=0.0)  # (BLOCK_D, BLOCK_K)
            s = tl.dot(x, c, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_K) cosines
            if HAS_BIAS:
                s += tl.load(BIAS + h * K + cols, mask=in_cols, other=0.0)[None, :]
            s = tl.where(in_cols[None, :], s, float("-inf"))
            best, arg = _better(s, cols, k0, chosen, best, arg, t > 0)  # t > 0: the earlier passes' picks left out
        chosen = tl.where(slots[None, :] == t, arg[:, None], chosen)
        tl.store(PROBES + (bh * N + rows) * P + t, arg.to(tl.int64), mask=in_rows)
        if t == 0:
            first_best = best
            first_arg = arg
    cosine = first_best
    if HAS_BIAS:
        cosine -= tl.load(BIAS + h * K + first_arg, mask=in_rows, other=0.0)
    tl.store(COSINE + bh * N + rows, cosine, mask=in_rows)
    tl.atomic_add(COUNTS + bh * K + first_arg, tl.full((BLOCK_N,), 1, tl.int32), mask=in_rows)


@triton.jit
def reduce(R, ORDER, STARTS, COUNTS, VALID, SUMS, WEIGHTS, B, H, N, K, D,
           HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """SUMS (H, K, D) and WEIGHTS (H, K) float32: the routing vectors R (B·H, N, D) of each cluster's real
    positions (VALID (B, N) bool, or every one), summed over its run [STARTS, STARTS + COUNTS) of the sorted order
    ORDER (B·H, N) in every batch entry, in a fixed order. Grid (K, H)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    total = tl.zeros((BLOCK_D,), tl.float32)
    weight = tl.zeros((BLOCK_N,), tl.float32)
    for b in range(0, B):
        bh = (b * H + h).to(tl.int64)
        start = tl.load(STARTS + bh * K + c)
        count = tl.load(COUNTS + bh * K + c)
        for i0 in range(0, count, BLOCK_N):
            i = i0 + tl.arange(0, BLOCK_N)
            inside = i < count
            pos = tl.load(ORDER + bh * N + start + i, mask=inside, other=0)
            w = inside.to(tl.float32)
            if HAS_VALID:
                w *= tl.load(VALID + b * N + pos, mask=inside, other=0).to(tl.float32)
            x = tl.load(R + (bh * N + pos[:, None]) * D + d[None, :], mask=inside[:, None] & (d[None, :] < D),
                        other=0.0)
            total += tl.sum(x * w[:, None], axis=0)
            weight += w
    tl.store(SUMS + (h * K + c) * D + d, total, mask=d < D)
    tl.store(WEIGHTS + h * K + c, tl.sum(weight, axis=0))


@triton.jit
def select(Q, S, CHOSEN, N, NB, D, BLOCK,
           TOP: tl.constexpr, TOP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_D: tl.constexpr):
    """Q (B·H, N, D) the queries as they score (MoBA's q; Quest's bound: [q⁺, q]), S (B·H, NB, D) the blocks'
    summaries (the mean keys; [hi - lo, lo]) -> CHOSEN (B·H, N, TOP) int64: the TOP best blocks j < i // BLOCK of
    query i by Q_i · S_j, best first (ties to the lower index), -1 where it has fewer. Grid (cdiv(N, BLOCK_N),
    B·H)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < N
    limit = rows // BLOCK  # the blocks before the row's own
    d = tl.arange(0, BLOCK_D)
    x = tl.load(Q + (bh * N + rows[:, None]) * D + d[None, :], mask=in_rows[:, None] & (d[None, :] < D), other=0.0)
    stop = tl.minimum(NB, (tl.minimum(pid * BLOCK_N + BLOCK_N, N) - 1) // BLOCK)  # no row here sees a later block
    chosen = tl.full((BLOCK_N, TOP_PAD), -1, tl.int32)
    slots = tl.arange(0, TOP_PAD)
    for t in tl.static_range(TOP):
        best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        arg = tl.full((BLOCK_N,), -1, tl.int32)
        for k0 in range(0, stop, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            summary = tl.load(S + (bh * NB + cols[None, :]) * D + d[:, None], mask=(d[:, None] < D) &
                              (cols[None, :] < NB), other=0.0)  # (BLOCK_D, BLOCK_K)
            s = tl.dot(x, summary, input_precision=DOT_PRECISION)
            s = tl.where(cols[None, :] < limit[:, None], s, float("-inf"))
            best, arg = _better(s, cols, k0, chosen, best, arg, t > 0)
        chosen = tl.where(slots[None, :] == t, arg[:, None], chosen)
        tl.store(CHOSEN + (bh * N + rows) * TOP + t, arg.to(tl.int64), mask=in_rows)


@triton.jit
def move(X, INDEX, OUT, H, N, M, D, SB, SH, SN, SD,
         SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT (B·H, M, D) contiguous: OUT[bh, j] = X[b, h, min(INDEX[bh, j], N - 1)] · SCALE, X (B, H, N, D) of
    strides (SB, SH, SN, SD), INDEX (B·H, M) int64. Grid (cdiv(M, BLOCK_M), B·H). SCALE is a constant of the
    compiled kernel (one per model's key scale; a float argument would be float32, short of float64 rows')."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    inside = rows < M
    src = tl.minimum(tl.load(INDEX + bh * M + rows, mask=inside, other=0), N - 1)
    d = tl.arange(0, BLOCK_D)
    keep = inside[:, None] & (d[None, :] < D)
    x = tl.load(X + b * SB + h * SH + src[:, None] * SN + d[None, :] * SD, mask=keep)
    if SCALE != 1.0:  # in float32, or float64 for float64 rows: rounded once to the rows' type
        wide = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
        x = (x.to(wide) * SCALE).to(OUT.dtype.element_ty)
    tl.store(OUT + (bh * M + rows[:, None]) * D + d[None, :], x, mask=keep)
