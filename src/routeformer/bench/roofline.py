"""How far each attention row is from the machine's limit: useful FLOPs per second beside measured matmul speed.

Useful FLOPs are the work the definition needs, not what an implementation spends: for softmax patterns 4·D per
(query, key) pair the query sees (its score and its share of the weighted sum, 2·D each; the counts are causal,
non-causal softmax rows show n/a), counted exactly for the fixed patterns and from the actual clusters or buckets
for routing and LSH (plus the routing scores against the k centroids, or the hash projections); for linear attention
and Performer the feature maps, the state each token adds and the read-out (4·F·D + 4·F per token, plus Performer's
4·m·D projections). Padded tiles, masked entries and recomputation are not useful work. The backward pass counts
twice the forward (``FWD_BWD``), as for a matmul.

The roofline is this machine's dense matmul (2048³, the benchmark's dtype) measured in the same run; a row's
distance from it is matmul GFLOP/s / its useful GFLOP/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .measure import format_table, synchronize

FWD_BWD = 3.0  # forward + backward useful work, in forwards
Useful = Callable[[Tensor], float]  # q (B, H, N, D) -> forward useful FLOPs


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """This machine's dense (size × size) @ (size × size) speed in GFLOP/s: the best of ``repeats`` after one
    warm-up (the limit, so the fastest run)."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(device, dtype) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def _float_range(n: int) -> Tensor:
    return torch.arange(n, dtype=torch.float64)


def pairs_full(n: int) -> float:
    return n * (n + 1) / 2


def pairs_local(n: int, window: int) -> float:
    return float(torch.clamp(_float_range(n) + 1, max=window).sum())


def pairs_strided(n: int, stride: int, merged: bool) -> float:
    """Per head: merged A1 ∪ A2 (the last l + 1 positions, every l-th one back; i and i - l in both); split, half
    the heads A1 and half A2."""
    i = _float_range(n)
    a1 = torch.clamp(i + 1, max=stride + 1)
    a2 = torch.div(i, stride, rounding_mode="floor") + 1
    if merged:
        return float((a1 + a2 - 1 - (i >= stride).double()).sum())
    return float((a1.sum() + a2.sum()) / 2)


def pairs_fixed(n: int, block: int, summary: int) -> float:
    """Merged: the own block so far, and the last ``summary`` cells of every block so far (counted once)."""
    i = _float_range(n)
    own = torch.remainder(i, block) + 1
    first = block - summary  # a block's summary cells start here
    blocks = torch.div(i + 1, block, rounding_mode="floor")  # whole blocks up to i
    cells = blocks * summary + torch.clamp(torch.remainder(i + 1, block) - first, min=0)
    both = torch.clamp(own - first, min=0)
    return float((own + cells - both).sum())


def pairs_longformer(n: int, window: int, dilations: Sequence[int], global_tokens: Sequence[int]) -> float:
    """Per head, averaged: the dilated band (window positions d apart), and each global key not already in it
    (global tokens at 0 only: the key 0 for every query; a global query's row is its band here)."""
    if list(global_tokens) not in ([], [0]):
        raise ValueError("pairs_longformer counts global tokens at position 0 only")
    i = _float_range(n)
    total = 0.0
    for d in dilations:
        band = torch.clamp(torch.div(i, d, rounding_mode="floor") + 1, max=window)
        if global_tokens:
            in_band = (torch.remainder(i, d) == 0) & (torch.div(i, d, rounding_mode="floor") < window)
            band = band + (~in_band).double()
        total += float(band.sum())
    return total / len(dilations)


def pairs_in_groups(groups: Tensor, probes: Tensor, window: int, exclude_self: bool) -> float:
    """Per head, averaged: each query sees the last ``window`` keys j <= i of each group it probes; groups (B, H, N)
    each key's group, probes (B, H, N, p) each query's groups (its own first when ``exclude_self``, where its own
    key is left out unless it sees nothing else). A query's probes are distinct groups, so no key counts twice;
    summing over LSH's rounds does count a key two rounds share twice (an upper bound)."""
    B, H, N = groups.shape
    count = F.one_hot(groups, int(max(groups.max(), probes.max())) + 1).cumsum(2)  # (B, H, N, G): keys j <= i
    seen = count.gather(-1, probes).clamp(max=window).sum(-1).double()  # (B, H, N)
    if exclude_self:
        seen = torch.clamp(seen - 1, min=1)
    return float(seen.sum()) / (B * H)


def softmax_flops(pairs_per_head: float, q: Tensor) -> float:
    """4·D FLOPs per (query, key) pair, over every batch element and head."""
    B, H, _, D = q.shape
    return 4.0 * D * pairs_per_head * B * H


def feature_flops(features: int, q: Tensor, projection: bool = False) -> float:
    """Linear attention's useful work per token: state update and read-out (4·F·D), normaliser (4·F), and with
    ``projection`` Performer's features of q and k (2 · 2·m·D)."""
    B, H, N, D = q.shape
    per_token = 4 * features * D + 4 * features + (4 * features * D if projection else 0)
    return float(per_token) * B * H * N


def roofline_table(rows: list[dict], matmul: float) -> str:
    """Useful GFLOP (forward + backward), the GFLOP/s they were done at, and the distance from the matmul speed
    ``matmul`` measured in the same run."""
    out = []
    for r in rows:
        useful, took = r.get("useful_flops"), r.get("fwd_bwd_s")
        if useful is None or took is None:
            out.append([r["n"], r["mechanism"], "n/a", "n/a", f"{matmul:.0f}", "n/a"])
            continue
        work = FWD_BWD * useful
        rate = work / took / 1e9
        out.append([r["n"], r["mechanism"], f"{work / 1e9:.2f}", f"{rate:.1f}", f"{matmul:.0f}",
                    f"{matmul / rate:.1f}×"])
    return format_table(["N", "roofline: mechanism", "useful GFLOP fwd+bwd", "useful GFLOP/s", "matmul GFLOP/s",
                         "× from the roofline"], out)
