"""The fused kernels at the shapes users run: float32 results of the band (local attention), ranges (routing's probes)
and rounds (LSH) operators against the float64 dense definition, forward and gradients, at N = 4096 and D = 64 with
windows and ranges longer than the kernels' key chunk, and the same bits at 1 to 4 threads.

The kernels take a block's keys in chunks of ``KC`` (512, ``csrc/common.h``) with an online softmax: a row's running
maximum m and sum l are rescaled by exp(m_old - m_new) when a later chunk holds a larger score, and the output
accumulated so far with them. Every case here gives rows more keys than one chunk holds (windows of 600 and 1100,
ranges of up to 1100 keys placed at random, so they straddle their block's chunk boundaries; LSH windows of 600 in
buckets of about 1000), so a wrong rescale is a wrong output for most rows. With scores q·k/sqrt(D) of unit variance a
row's maximum moves by O(0.1 .. 1) from one chunk to the next: a rescale that is skipped (alpha = 1) or wrong weights
the earlier chunk by a factor off by that much, and the output moves by O(0.1), a thousand times the output tolerance
below: the forward assertion (``compare``'s first) catches it. Checked once by replacing ``std::exp(m[r] - m_new)`` in
``forward_block`` with 1: each of the 14 dense comparisons here failed on its output (errors 0.01 to 4.8), the thread
tests passed, as they should; the fused, pattern, routing and executor test files, whose rows see fewer keys than
one chunk, all passed with it.

Tolerances come from float32 arithmetic, not from the kernel's measured error: a score q·k over D = 64 terms of unit
products, scaled, carries an error of a few eps (eps = 2^-23 ≈ 1.2e-7) relative to |q||k|/sqrt(D) ~ 8; exp of a score
with absolute error δ has relative error δ; a softmax-weighted mean over up to n ≈ 2200 keys accumulates at most
n·eps ≈ 2.6e-4 in the worst case of one-signed rounding and about sqrt(n)·eps ≈ 6e-6 typically. Outputs are means of
unit-variance values (|out| <= max |v| ~ 4): 1e-4 absolute plus 1e-4 relative is some 15 times the typical error and
below the worst case, where a wrong chunk rescale moves outputs by 1e-1. Gradients of q, k and v are sums over the
same up to 2200 keys or queries, of terms that cancel: they are compared relative to their largest entry, max |got -
want| <= 1e-4 · max |want| (again some 15 times sqrt(n)·eps); the relative tables' gradients sum over every pair of a
head (up to N · 2200 ≈ 9e6, sqrt of that times eps ≈ 4e-4) and get 1e-3.

Slow (``pytest -m slow``): the N = 4096 comparisons. Fast, in the default suite: one N = 1100 to 1400 problem of each
kind (rows crossing a chunk boundary) and the thread-count tests.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from helpers import rand_rel
from routeformer.attention import LocalOptions, LSHOptions, local_attention, reference_attention
from routeformer.attention.local import local_mask
from routeformer.attention.lsh import lsh_attention, lsh_mask, lsh_rotations
from routeformer.executors import Inputs, get_executor
from routeformer.executors.fused import available, executor
from routeformer.executors.ranges import KeyOrder, Ranges

CSRC = Path(executor.__file__).parent / "csrc"
KC = int(re.search(r"constexpr int64_t KC = (\d+);", (CSRC / "common.h").read_text()).group(1))
D = 64
OUT_ATOL = OUT_RTOL = 1e-4  # float32 against float64, outputs of magnitude <= ~4 (see the module's docstring)
GRAD_REL = 1e-4  # max |error| / max |gradient| for q, k, v
TABLE_REL = 1e-3  # the same for the relative tables' gradients (sums over every pair)


@pytest.fixture(autouse=True, scope="module")
def _the_kernels_run() -> None:
    """The comparisons mean nothing if the tiles executor runs instead (a build that fell back)."""
    assert available(), "the fused kernels did not load"
    status = executor.KERNELS.status()
    assert status.ok and not status.failures, status.why()


def test_the_cases_cross_the_chunk() -> None:
    assert KC == 512  # the sizes below are chosen around it: 600 and 1100 windows, ranges up to 1100 keys


# --- the dense definition in float64 --------------------------------------------------------------------------


def dense(q: Tensor, k: Tensor, v: Tensor, allow: Tensor, scale: float, rel=None, delta: Tensor | None = None):
    """softmax_j(scale · q_i · (k_j + a^K[d_ij])) over the allowed j, times (v_j + a^V[d_ij]), summed; zeros for a
    row with no allowed key. q (B, H, Nq, D), k, v (B, H, N, D), allow (B, H, Nq, N) bool; with ``rel``, delta
    (broadcast to (B, H, Nq, N)) the pairs' distances, clipped to the tables (``RelativePositions.index``). Written
    quadratically and independently of the executors: the relative terms are the rows q·a^Kᵀ gathered per pair
    (not the (N, N, D) tensors of ``reference_attention``, 8 GB at N = 4096)."""
    s = q @ k.transpose(-1, -2) * scale
    if rel is not None:
        idx = rel.index(delta).expand(s.shape)
        s = s + (q @ rel.key.T).gather(-1, idx) * scale
    seen = allow.any(-1, keepdim=True)
    p = s.masked_fill(~allow, float("-inf")).where(seen, 0.0).softmax(-1) * seen
    out = p @ v
    if rel is not None:  # Σ_j p_ij a^V[d_ij]: the probabilities summed per table row
        per_row = torch.zeros(*p.shape[:-1], rel.value.shape[0], dtype=p.dtype).scatter_add(-1, idx, p)
        out = out + per_row @ rel.value
    return out


def test_the_plain_definition_is_reference_attention() -> None:
    """``dense`` with relative positions against the project's definition (literal tables), where those fit."""
    g = torch.Generator().manual_seed(0)
    B, H, N = 2, 2, 70
    q, k, v = (torch.randn(B, H, N, 8, dtype=torch.float64, generator=g) for _ in range(3))
    rel = rand_rel(8, 9)
    padding = torch.rand(B, N, generator=g) > 0.3
    mask = local_mask(N, 20, causal=False)
    allow = mask & padding[:, None, None, :]
    i = torch.arange(N)
    got = dense(q, k, v, allow, 8**-0.5, rel, i[None, :] - i[:, None])
    want = reference_attention(Inputs.of(q, k, v, key_padding_mask=padding), mask, rel=rel)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# --- comparing float32 with float64 ---------------------------------------------------------------------------


def float32_leaves(*xs: Tensor) -> list[Tensor]:
    return [x.float().detach().requires_grad_() for x in xs]


def float64_leaves(*xs: Tensor) -> list[Tensor]:
    return [x.detach().double().requires_grad_() for x in xs]


def tables(rel) -> tuple:
    """A float32 ``RelativePositions`` and its float64 copy (the same values, separate leaves)."""
    if rel is None:
        return None, None
    rel32 = copy.deepcopy(rel).float()
    return rel32, copy.deepcopy(rel32).double()


def compare(got: Tensor, want: Tensor, leaves32: list[Tensor], leaves64: list[Tensor], names: list[str],
            seed: int = 0) -> None:
    """Forward within OUT_ATOL + OUT_RTOL·|want|; every gradient (a fixed random upstream gradient, the same in both)
    within GRAD_REL (TABLE_REL for the relative tables) of its largest entry."""
    assert got.dtype == torch.float32 and want.dtype == torch.float64 and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want.detach(), rtol=OUT_RTOL, atol=OUT_ATOL, msg=lambda m: f"out: {m}")
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed))
    grads32 = torch.autograd.grad(got, leaves32, upstream)
    grads64 = torch.autograd.grad(want, leaves64, upstream.double())
    for name, a, b in zip(names[: len(leaves32)], grads32, grads64, strict=True):
        assert torch.isfinite(a).all(), f"non-finite gradient of {name}"
        bound = (TABLE_REL if name.startswith("a^") else GRAD_REL) * b.abs().max().item()
        err = (a.double() - b).abs().max().item()
        assert err <= bound, f"gradient of {name}: max error {err:.3g} > {bound:.3g}"


def padding(B: int, N: int, seed: int) -> Tensor:
    """(B, N) key validity: batch 0 with its first eighth invalid (its first rows see nothing when causal) and random
    holes; the others with random holes only (a chunk then holds invalid keys anywhere)."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(B, N, generator=g) > 0.25
    valid[0, : N // 8] = False
    return valid


def qkv(B: int, H: int, N: int, seed: int, Nq: int | None = None) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g) for n in (Nq or N, N, N)]


# --- band: local attention ------------------------------------------------------------------------------------


def check_band(N: int, window: int, causal: bool, *, B: int = 2, H: int = 1, relative: int = 0, seed: int = 0):
    q, k, v = qkv(B, H, N, seed)
    valid = padding(B, N, seed)
    rel32, rel64 = tables(rand_rel(D, relative, seed=seed) if relative else None)
    leaves32, leaves64 = float32_leaves(q, k, v), float64_leaves(q, k, v)
    extra32 = [rel32.key, rel32.value] if rel32 is not None else []
    extra64 = [rel64.key, rel64.value] if rel64 is not None else []
    got = local_attention(Inputs.of(*leaves32, key_padding_mask=valid), LocalOptions(window), "fused", causal=causal,
                          rel=rel32)
    window_mask = local_mask(N, window, causal)
    assert window_mask.sum(-1).max() > KC, "rows' intervals must be longer than one chunk"
    allow = window_mask & valid[:, None, None, :]
    if rel64 is None:
        want = reference_attention(Inputs.of(*leaves64, key_padding_mask=valid), window_mask)
    else:
        i = torch.arange(N)
        want = dense(*leaves64, allow, D**-0.5, rel64, i[None, :] - i[:, None])
    compare(got, want, leaves32 + extra32, leaves64 + extra64, ["q", "k", "v", "a^K", "a^V"])


def test_band_across_the_chunk() -> None:
    check_band(1100, 600, causal=False, relative=300)


@pytest.mark.slow
@pytest.mark.parametrize("window", [600, 1100])
@pytest.mark.parametrize("causal", [True, False])
def test_band_at_4096(window: int, causal: bool) -> None:
    check_band(4096, window, causal, seed=window + causal)


@pytest.mark.slow
def test_band_at_4096_with_relative_positions() -> None:
    """Distances beyond the tables (max distance 700 < window 1100) clip; the table rows ride along the chunks."""
    check_band(4096, 1100, causal=False, relative=700, seed=7)


# --- ranges: routing's probes ---------------------------------------------------------------------------------


def ranges_problem(B: int, H: int, N: int, merge: int, width: int, seed: int):
    """Query row i asks with entries i·merge .. i·merge + merge - 1, entry t of a row inside [t·N/merge,
    (t + 1)·N/merge) (disjoint), of random length up to ``width`` (a quarter of them longer than KC), at a random
    place: (lo, hi) (B, H, N·merge) and a random key order per head."""
    g = torch.Generator().manual_seed(seed)
    M, part = N * merge, N // merge
    t = torch.arange(M) % merge
    length = torch.randint(0, width + 1, (B, H, M), generator=g)
    long = torch.rand(B, H, M, generator=g) < 0.25
    length = torch.where(long, torch.randint(KC + 1, width + 1, (B, H, M), generator=g), length)
    length[..., :merge] = 0  # a row that sees nothing
    lo = t * part + (torch.rand(B, H, M, generator=g) * (part - length + 1)).long()
    hi = lo + length
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)
    return lo, hi, order


def check_ranges(N: int, merge: int, width: int, *, B: int = 2, H: int = 1, relative: int = 0, seed: int = 0):
    q, k, v = qkv(B, H, N, seed)
    lo, hi, order = ranges_problem(B, H, N, merge, width, seed)
    valid = padding(B, N, seed)[:, None, :]  # (B, 1, N) per row of k
    rel32, rel64 = tables(rand_rel(D, relative, seed=seed) if relative else None)
    pos = torch.arange(N).expand(B, H, N)  # query row i at position i, row j of k at position j
    spans = Ranges(lo, hi, width, merge, query_pos=pos, key_pos=pos)
    leaves32, leaves64 = float32_leaves(q, k, v), float64_leaves(q, k, v)
    extra32 = [rel32.key, rel32.value] if rel32 is not None else []
    extra64 = [rel64.key, rel64.value] if rel64 is not None else []
    got, _ = get_executor("fused").ranges(Inputs(*leaves32, D**-0.5, valid), spans,
                                          order=KeyOrder(order, order.argsort(-1)), rel_pos=rel32)
    # the definition: row i sees the union of its entries' ranges of k[order], less the invalid keys
    idx = torch.arange(N)
    seq = ((idx >= lo[..., None]) & (idx < hi[..., None])).view(B, H, N, merge, N).any(3)  # by sorted index
    allow = torch.zeros(B, H, N, N, dtype=torch.bool).scatter_(-1, order[:, :, None, :].expand(B, H, N, N), seq)
    allow &= valid[:, :, None, :]
    assert (hi - lo).max() > KC and (~allow.any(-1)).any()
    want = dense(*leaves64, allow, D**-0.5, rel64, idx[None, :] - idx[:, None])
    compare(got, want, leaves32 + extra32, leaves64 + extra64, ["q", "k", "v", "a^K", "a^V"], seed=seed)


@pytest.mark.parametrize("merge", [1, 2])
def test_ranges_across_the_chunk(merge: int) -> None:
    check_ranges(1100, merge, 700 if merge == 1 else 540, relative=40 if merge == 2 else 0)


@pytest.mark.slow
@pytest.mark.parametrize("merge", [1, 2])
def test_ranges_at_4096(merge: int) -> None:
    check_ranges(4096, merge, 1100, seed=merge)


@pytest.mark.slow
def test_ranges_at_4096_with_relative_positions() -> None:
    """Distances between positions in a random key order: irregular per pair, clipped at 64."""
    check_ranges(4096, 2, 1100, relative=64, seed=3)


# --- LSH rounds -----------------------------------------------------------------------------------------------


def check_lsh(N: int, window: int, causal: bool, *, buckets: int = 4, B: int = 2, H: int = 1, seed: int = 0):
    """Two rounds; the buckets hold about N / buckets positions, more than the window (which is more than KC)."""
    q, _, v = qkv(B, H, N, seed)
    valid = padding(B, N, seed)
    rot = lsh_rotations(H, D, buckets, 2, seed=seed)
    kw = dict(buckets=buckets, rounds=2, window=window, causal=causal, key_padding_mask=valid, rotations=rot)
    (q32, v32), (q64, v64) = float32_leaves(q, v), float64_leaves(q, v)
    got = lsh_attention(Inputs.of(q32, q32, v32, key_padding_mask=valid), LSHOptions(buckets, 2, window), "fused",
                        causal=causal, rotations=rot)
    mask = lsh_mask(q32.detach(), **kw)  # hashed in float32, as the call above: the same buckets
    assert lsh_mask(q32.detach(), **{**kw, "key_padding_mask": None}).sum(-1).max() > KC
    want = reference_attention(Inputs.of(q64, F.normalize(q64, dim=-1), v64), mask)
    compare(got, want, [q32, v32], [q64, v64], ["q", "v"], seed=seed)


def test_lsh_across_the_chunk() -> None:
    check_lsh(1400, 600, causal=True, buckets=2)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_lsh_at_4096(causal: bool) -> None:
    check_lsh(4096, 600, causal, seed=int(causal))


# --- the same bits at 1, 2, 3 and 4 threads -------------------------------------------------------------------


def _band_run(B, H, N, seed):
    q, k, v = qkv(B, H, N, seed)
    rel = tables(rand_rel(D, 300, seed=seed))[0]
    leaves = float32_leaves(q, k, v)
    out = local_attention(Inputs.of(*leaves, key_padding_mask=padding(B, N, seed)), LocalOptions(600), "fused",
                          causal=False, rel=rel)
    return out, leaves + [rel.key, rel.value]


def _ranges_run(B, H, N, seed):
    q, k, v = qkv(B, H, N, seed)
    lo, hi, order = ranges_problem(B, H, N, 2, 540, seed)
    rel = tables(rand_rel(D, 40, seed=seed))[0]
    pos = torch.arange(N).expand(B, H, N)
    leaves = float32_leaves(q, k, v)
    out, _ = get_executor("fused").ranges(
        Inputs(*leaves, D**-0.5, padding(B, N, seed)[:, None, :]), Ranges(lo, hi, 540, 2, query_pos=pos, key_pos=pos),
        order=KeyOrder(order, order.argsort(-1)), rel_pos=rel)
    return out, leaves + [rel.key, rel.value]


def _lsh_run(B, H, N, seed):
    q, _, v = qkv(B, H, N, seed)
    leaves = float32_leaves(q, v)
    q, v = leaves
    out = lsh_attention(Inputs.of(q, q, v, key_padding_mask=padding(B, N, seed)), LSHOptions(2, 2, 600), "fused",
                        rotations=lsh_rotations(H, D, 2, 2, seed=seed))
    return out, leaves


RUNS = {"band": _band_run, "ranges": _ranges_run, "lsh": _lsh_run}


@pytest.mark.parametrize("kind", sorted(RUNS))
@pytest.mark.parametrize("B, H", [(1, 1), (2, 3)])  # fewer (batch · heads) than threads, and more
def test_the_same_bits_at_one_to_four_threads(kind: str, B: int, H: int) -> None:
    """Forward and every gradient (q, k, v and the relative tables) bit for bit at 1, 2, 3 and 4 threads: each
    head's key gradients are summed by one thread in a fixed order, no result depends on how the blocks are shared
    out, and each matrix product runs on its caller's thread (MKL left to its own thread count split the local
    band's products with relative tables differently at 1 and 2 threads: 1e-6 apart). N = 1400: blocks of rows
    crossing chunk boundaries (windows of 600 keys, ranges of up to 540)."""
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            assert torch.get_num_threads() == n
            out, leaves = RUNS[kind](B, H, 1400, seed=11)
            upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            results.append([out.detach(), *torch.autograd.grad(out, leaves, upstream)])
    finally:
        torch.set_num_threads(threads)
    for n, result in zip((2, 3, 4), results[1:], strict=True):
        for i, (a, b) in enumerate(zip(results[0], result, strict=True)):
            assert torch.equal(a, b), f"{kind}: result {i} (0: out, then the gradients) differs at {n} threads"
