"""Executor.ranges: every query entry against its own contiguous range of keys, on every executor, against the
dense reference (forward and gradients), with relative positions, padding, reordered keys and block shapes that
force every case of the blocking (entries left over, empty slots, empty ranges)."""

from __future__ import annotations

import pytest
import torch

from helpers import rand_padding, rand_qkv, rand_rel
from routeformer.executors import Inputs, get_executor, neg_inf, ranges
from routeformer.executors.flex import ranges as flex_ranges
from routeformer.executors.ranges import KeyOrder, Ranges

gathered = ranges._gathered
NATIVE = ("fused", "flex")  # executors with their own ranges (the range test inside the kernel's mask)


def _small_flex(monkeypatch) -> None:
    """Flex blocks of 16 rows and keys, so that the test's ~50 entries span several blocks and the block mask has
    blocks to leave out, and its relative value pass in chunks of 3 entries."""
    monkeypatch.setattr(flex_ranges, "BLOCK", 16)
    monkeypatch.setattr(flex_ranges, "CHUNK", 3 * 6 * 8 * 4)  # 3 entries of B·H = 4, width 6, D = 8


def _problem(B, H, N, M, width, seed):
    g = torch.Generator().manual_seed(seed)
    hi = torch.randint(0, N + 1, (B, H, M), generator=g)
    hi[..., :3] = torch.tensor([N, 0, hi[0, 0, 3]])  # the last key, an empty range at 0, a repeated end
    lo = (hi - torch.randint(0, width + 1, (B, H, M), generator=g)).clamp_min(0)
    rows = torch.randint(0, N, (B, H, M), generator=g)  # entry m is query row rows[m]
    key_rows = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)
    return lo, hi, rows, key_rows


def _reference(q, k, v, lo, hi, rows, key_rows, *, scale, valid, rel, key_pos):
    """The definition, written out in float64: entry m sees rows key_rows[lo_m : hi_m] of k."""
    B, H, N, D = k.shape
    M = lo.shape[-1]
    idx = torch.arange(N)
    seq = (idx >= lo[..., None]) & (idx < hi[..., None])  # (B, H, M, N) over the key sequence
    allow = torch.zeros(B, H, M, N, dtype=torch.bool).scatter_(-1, key_rows[:, :, None, :].expand(B, H, M, N), seq)
    if valid is not None:
        allow = allow & valid[:, :, None, :]
    qe = q.gather(2, rows[..., None].expand(B, H, M, D))
    query_pos = rows  # entries sit at their query row's position
    delta = key_pos[:, :, None, :] - query_pos[..., None]  # (B, H, M, N)
    s = qe @ k.transpose(-1, -2) * scale
    if rel is not None:
        a_key, a_value = rel.tables(delta, q.dtype)
        s = s + (qe[:, :, :, None, :] * a_key).sum(-1) * scale
    s = s.masked_fill(~allow, float("-inf"))
    seen = allow.any(-1, keepdim=True)
    p = torch.where(seen, s, 0.0).softmax(-1) * seen
    out = p @ v
    if rel is not None:
        out = out + (p[..., None] * a_value).sum(-2)
    lse = torch.where(seen[..., 0], torch.where(allow, s, float("-inf")).logsumexp(-1), neg_inf(s.dtype))
    return out, lse


@pytest.mark.parametrize("backend", ["tiles", "flex", "fused"])
@pytest.mark.parametrize("extras", ["plain", "relative", "padding"])
@pytest.mark.parametrize("shape", [(None, None), (3, 4), (1, 16), "compiling"])
def test_ranges_match_the_dense_definition(backend: str, extras: str, shape, monkeypatch) -> None:
    """Block shapes: the defaults; tiles of 4 rows per stretch of 3 keys (many entries left over for the gathered
    pass); one key per stretch; and the path taken under torch.compile (every entry gathered, no host read). Flex:
    blocks of 16 and its relative value pass in chunks of 3 entries."""
    _small_flex(monkeypatch)
    passes = []
    monkeypatch.setattr(ranges, "_gathered", lambda *a, **kw: passes.append(kw.get("bound")) or gathered(*a, **kw))
    compiling = shape == "compiling"
    if compiling:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        shape = (None, None)
    B, H, N, M, D, width = 2, 2, 37, 53, 8, 6
    q, k, v = rand_qkv(B, H, N, D)
    lo, hi, rows, key_rows = _problem(B, H, N, M, width, seed=len(extras))
    rel = rand_rel(D, 5) if extras == "relative" else None
    padding = rand_padding(B, N) if extras == "padding" else None
    valid = None if padding is None else padding[:, None, :]
    key_pos = torch.arange(N).expand(B, H, N)  # row j of k is position j
    stretch, block_rows = shape
    entries = q.gather(2, rows[..., None].expand(B, H, M, D))  # entry m asks with query rows[m] (repeats too)
    out, lse = get_executor(backend).ranges(
        Inputs(entries, k, v, D**-0.5, valid),
        Ranges(lo, hi, width, query_pos=rows, key_pos=key_pos, stretch=stretch, rows=block_rows),
        order=KeyOrder(key_rows, key_rows.argsort(-1)), rel_pos=rel, need_lse=True)
    ref, ref_lse = _reference(q, k, v, lo, hi, rows, key_rows, scale=D**-0.5, valid=valid, rel=rel,
                              key_pos=key_pos)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    if backend in NATIVE:
        assert passes == [], f"the {backend} executor tests the ranges inside its kernel"
    elif compiling:
        assert passes == [True], "every entry through the gathered pass, at its size bound"
    elif shape == (3, 4):
        assert passes == [None], "entries were left over for the gathered pass"
    seen = ref_lse > neg_inf(ref_lse.dtype) / 2
    assert (~seen).any() and seen.any()
    torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=1e-10, atol=1e-10)
    assert (lse[~seen] == neg_inf(lse.dtype)).all()
    leaves = [q, k, v] + ([rel.key, rel.value] if rel is not None else [])
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["tiles", "flex", "fused"])
@pytest.mark.parametrize("shift", [0, 3])
def test_unit_distances_match_the_dense_definition(backend: str, shift: int, monkeypatch) -> None:
    """Keys in their own order and positions that are the sequence indices (shift 0: the fused kernel then reads
    the relative tables along each row's stretch, as for block selection), or the same distances from positions
    shifted by 3 (one table index per pair): both the definition, with ranges before, around and after each query
    and distances clipped on both sides, forward and gradients."""
    _small_flex(monkeypatch)
    B, H, N, D, width = 2, 2, 37, 8, 6
    q, k, v = rand_qkv(B, H, N, D)
    lo, hi, _, _ = _problem(B, H, N, N, width, seed=7)  # entry i asks with query i
    rel = rand_rel(D, 3)
    pos = (torch.arange(N) + shift).expand(B, H, N)
    out, lse = get_executor(backend).ranges(Inputs(q, k, v, D**-0.5, None), Ranges(lo, hi, width, query_pos=pos,
                                                                                   key_pos=pos),
                                            rel_pos=rel, need_lse=True)
    identity = torch.arange(N).expand(B, H, N)
    ref, ref_lse = _reference(q, k, v, lo, hi, identity, identity, scale=D**-0.5, valid=None, rel=rel,
                              key_pos=identity)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    seen = ref_lse > neg_inf(ref_lse.dtype) / 2
    torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    leaves = [q, k, v, rel.key, rel.value]
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, leaves, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_relative_positions_without_positions_are_refused(backend: str) -> None:
    q, k, v = rand_qkv(1, 1, 8, 4, grad=False)
    lo = hi = torch.zeros(1, 1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="need query_pos and key_pos"):
        get_executor(backend).ranges(Inputs(q, k, v, 0.5), Ranges(lo, hi, 2), rel_pos=rand_rel(4, 2))


@pytest.mark.parametrize("backend", ["tiles", "flex", "fused"])
@pytest.mark.parametrize("merge, extras", [(2, "plain"), (3, "relative"), (2, "padding")])
def test_merged_entries_are_one_softmax_over_their_ranges(backend: str, merge: int, extras: str,
                                                         monkeypatch) -> None:
    """merge = p: query row i asks with p entries whose ranges are disjoint; its output is the softmax over their
    union (each key once), the entries left over for the gathered pass included (stretches of 3 keys, 4 rows)."""
    _small_flex(monkeypatch)
    passes = []
    monkeypatch.setattr(ranges, "_gathered", lambda *a, **kw: passes.append(1) or gathered(*a, **kw))
    B, H, N, Nq, D, width = 2, 2, 41, 23, 8, 6
    q, k, v = rand_qkv(B, H, Nq, D)
    _, kk, vv = rand_qkv(B, H, N, D, seed=5)
    k, v = kk.detach().requires_grad_(), vv.detach().requires_grad_()
    g = torch.Generator().manual_seed(merge)
    part = N // merge  # entry t of a row lies in [t·part, (t + 1)·part): disjoint
    t = torch.arange(Nq * merge) % merge
    hi = t * part + torch.randint(0, part + 1, (B, H, Nq * merge), generator=g)
    lo = torch.maximum(hi - torch.randint(0, width + 1, (B, H, Nq * merge), generator=g), t * part)
    hi[0, 0, :merge] = lo[0, 0, :merge]  # a row that sees nothing
    key_rows = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)
    rel = rand_rel(D, 5) if extras == "relative" else None
    valid = rand_padding(B, N)[:, None, :] if extras == "padding" else None
    query_pos = torch.randint(0, N, (B, H, Nq), generator=g)
    key_pos = torch.arange(N).expand(B, H, N)
    out, lse = get_executor(backend).ranges(
        Inputs(q, k, v, D**-0.5, valid),
        Ranges(lo, hi, width, merge, query_pos=query_pos, key_pos=key_pos, stretch=3, rows=4),
        order=KeyOrder(key_rows, key_rows.argsort(-1)), rel_pos=rel, need_lse=True)
    # The definition: row i sees the union of its entries' ranges of the reordered keys.
    idx = torch.arange(N)
    seq = ((idx >= lo[..., None]) & (idx < hi[..., None])).view(B, H, Nq, merge, N).any(3)
    allow = torch.zeros(B, H, Nq, N, dtype=torch.bool).scatter_(-1, key_rows[:, :, None, :].expand(B, H, Nq, N), seq)
    if valid is not None:
        allow = allow & valid[:, :, None, :]
    s = q @ k.transpose(-1, -2) * D**-0.5
    if rel is not None:
        a_key, a_value = rel.tables(key_pos[:, :, None, :] - query_pos[..., None], q.dtype)
        s = s + (q[:, :, :, None, :] * a_key).sum(-1) * D**-0.5
    seen = allow.any(-1, keepdim=True)
    p = torch.where(allow, s, float("-inf")).where(seen, 0.0).softmax(-1) * seen
    ref = p @ v + ((p[..., None] * a_value).sum(-2) if rel is not None else 0)
    ref_lse = torch.where(seen[..., 0], torch.where(allow, s, float("-inf")).logsumexp(-1), neg_inf(s.dtype))
    assert passes == ([] if backend in NATIVE else [1]), "entries left over for the gathered pass (not natively)"
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert (~seen).any() and seen.any()
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    leaves = [q, k, v] + ([rel.key, rel.value] if rel is not None else [])
    grad, grad_lse = torch.randn_like(out), torch.randn_like(lse).where(seen[..., 0], 0.0)
    got = torch.autograd.grad((out * grad).sum() + (lse * grad_lse).sum(), leaves)
    want = torch.autograd.grad((ref * grad).sum() + (ref_lse * grad_lse).sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_entries_must_match_the_queries_and_merge(backend: str) -> None:
    q, k, v = rand_qkv(1, 1, 8, 4, grad=False)
    lo = hi = torch.zeros(1, 1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match="12 entries; 8 queries with merge=2 need 16"):
        get_executor(backend).ranges(Inputs(q, k, v, 0.5), Ranges(lo, hi, 2, 2))


def test_span_masks_are_the_columns_inside_each_range() -> None:
    """The looked-up mask against the comparison it replaces, over starts before, inside and after the span and
    ranges that are empty, reversed, cut at either end or wider than the span."""
    g = torch.Generator().manual_seed(0)
    width = 12
    first = torch.randint(-20, 40, (3, 7, 1), generator=g)
    last = first + torch.randint(-3, 30, (3, 7, 1), generator=g)
    start = torch.randint(-15, 25, (3, 1, 1), generator=g)
    columns = start + torch.arange(width)  # (3, 1, width)
    want = (columns >= first) & (columns < last)
    got = ranges.span_mask(first, last, start, width)
    assert got.dtype == torch.bool and got.shape == (3, 7, width)
    assert torch.equal(got, want)


def test_a_row_kernel_refuses_a_gather_autograd_would_record() -> None:
    """``gather_rows`` with a backend's kernel records no gradient: called where autograd records one, it says so
    rather than dropping the gradient; inside no_grad (an autograd Function's body) it runs the kernel."""
    from routeformer.executors.rows import gather_rows

    x = torch.randn(1, 2, 10, 4, requires_grad=True)
    index = torch.tensor([[[3, 1, 4]] * 2])
    calls = []

    def kernel(x, index, scale):
        calls.append(scale)
        return None  # does not take x: PyTorch's gather

    with pytest.raises(ValueError, match="records no gradient"):
        gather_rows(x, index, kernel)
    with torch.no_grad():
        got = gather_rows(x, index, kernel)
    assert calls == [1.0] and torch.equal(got, x.detach()[:, :, [3, 1, 4]])
