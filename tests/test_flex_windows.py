"""The sorted window on the flex executor (``executors/flex/windows.py``): each query's keys as one interval of the
cluster-sorted order, and block tables a few key blocks wide built from the intervals by a fixed number of
operators. On the CPU FlexAttention's eager operator reads only ``mask_mod``, so the tables are checked here
against the rule itself, kv-major and q-major; the results against the dense reference run in test_routing and
test_model (parametrised by backend), and against the tiles executor below."""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import OperatorCount, check_interval_tables, rand_padding, rand_rel
from routeformer.attention.routing.sorted_window import sort_by_cluster, sorted_window_mask
from routeformer.executors import Inputs, KeyRestrictions, SortedWindow, get_executor
from routeformer.executors.flex import blocks
from routeformer.executors.inputs import relative
from routeformer.executors.tiling import Distances
from routeformer.testing import FLEX_EAGER, host_reads

SMALL = 16  # block size in the table tests, so that ~200 positions span many blocks


def _clusters(B: int, H: int, N: int, k: int, seed: int) -> torch.Tensor:
    """Unbalanced clusters (B, H, N): some large, some of one position, some empty."""
    g = torch.Generator().manual_seed(seed)
    skew = torch.rand(B * H, k, generator=g) ** 3
    return torch.multinomial(skew, N, replacement=True, generator=g).view(B, H, N)


def _sorted(mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """A (B, H, N, N) mask in the original order, read in ``order`` along both axes."""
    N = mask.shape[-1]
    rows = mask.gather(-2, order[..., :, None].expand(-1, -1, -1, N))
    return rows.gather(-1, order[..., None, :].expand(-1, -1, N, -1))


@pytest.mark.parametrize("causal, own_key", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("window", [1, 2, 7, 40])
def test_intervals_are_the_sorted_window_of_the_definition(causal: bool, own_key: bool, window: int) -> None:
    """lo_s <= t <= hi_s is the definition's mask read in the sorted order (``own_key=False``: the shared-QK rule
    with every key real), and both bounds never decrease."""
    clusters = _clusters(2, 3, 150, 9, seed=window)
    sort = sort_by_cluster(clusters)
    lo, hi = SortedWindow(window, causal, sort.order, sort.grouped).intervals(own_when_alone=not own_key)
    t = torch.arange(150)
    got = (lo[..., :, None] <= t) & (t <= hi[..., :, None])
    want = _sorted(sorted_window_mask(clusters, window, causal, exclude_self=not own_key), sort.order)
    assert torch.equal(got, want)
    assert (lo.diff(dim=-1) >= 0).all() and (hi.diff(dim=-1) >= 0).all()


def test_a_two_sided_window_cannot_leave_the_own_key_out_of_its_interval() -> None:
    sort = sort_by_cluster(_clusters(1, 1, 20, 3, seed=0))
    with pytest.raises(ValueError, match="causal only"):
        SortedWindow(4, False, sort.order, sort.grouped).intervals(own_when_alone=True)


def _recorded(monkeypatch) -> list:
    """Every interval block mask the flex sorted window builds (blocks of SMALL positions), with its rule."""
    seen = []
    build = blocks.interval_block_mask

    def record(lo, hi, reach, mask_mod, **kw):
        mask = build(lo, hi, reach, mask_mod, **kw)
        seen.append((mask_mod, mask, reach))
        return mask

    monkeypatch.setattr(blocks, "BLOCK", SMALL)
    monkeypatch.setattr(blocks, "interval_block_mask", record)
    return seen


CASES = list(itertools.product([True, False], [False, True], [False, True]))  # causal, shared QK, padding


@pytest.mark.parametrize("causal, shared, padding", CASES)
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_block_tables_hold_the_blocks_of_the_rule(monkeypatch, causal: bool, shared: bool, padding: bool,
                                                  window: int) -> None:
    """kv-major and q-major, partial and full: the full blocks exactly those whose every pair the rule allows; the
    listed ones (partial or full) every block with an allowed pair, exactly those where the rule is the intervals
    alone (with padding, or shared QK in a two-sided window, whose rule leaves the diagonal out, a block whose keys
    in range are all padded or all own keys may be listed: mask_mod leaves it empty); C columns wide, C from the
    window; N = 203, not a multiple of the block."""
    seen = _recorded(monkeypatch)
    B, H, N, D = 2, 3, 203, 4
    clusters = _clusters(B, H, N, 6, seed=window)
    sort = sort_by_cluster(clusters)
    g = torch.Generator().manual_seed(1)
    q, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    valid = rand_padding(B, N)[:, None, :].expand(B, H, N).gather(-1, sort.order) if padding else None
    get_executor("flex").tiled(Inputs(q, q, v, 0.5, valid), SortedWindow(window, causal, sort.order, sort.grouped),
                               restrict=KeyRestrictions(exclude_self=shared))
    (mask_mod, mask, (back, ahead)), = seen
    reach = -(-(window - 1) // SMALL)
    assert (back, ahead) == (reach, 0 if causal else reach)
    check_interval_tables(mask_mod, mask, (B, H, N), SMALL, exact=not padding and not (shared and not causal))
    assert mask.kv_indices.shape == (B, H, -(-N // SMALL), back + 1 + ahead)


@pytest.mark.parametrize("causal, shared, padding", CASES)
@pytest.mark.parametrize("relative_positions", [False, True])
def test_flex_sorted_window_equals_the_tiles_executor(causal: bool, shared: bool, padding: bool,
                                                      relative_positions: bool) -> None:
    """Outputs, lse and gradients (float64) of the flex sorted window against the tiles executor's band with
    groups, windows shorter and longer than the clusters; N = 120 and N = 128 (the rule tests the indices of the
    last block's padding only where N leaves a partial block: both ways)."""
    B, H, D = 2, 2, 8
    for N, window in ((120, 3), (120, 50), (128, 3), (128, 50)):
        clusters = _clusters(B, H, N, 5, seed=window)
        sort = sort_by_cluster(clusters)
        g = torch.Generator().manual_seed(window)
        q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        k = q if shared else k
        valid = rand_padding(B, N)[:, None, :].expand(B, H, N).gather(-1, sort.order) if padding else None
        rel = rand_rel(D, 6) if relative_positions else None
        results = []
        for name in ("tiles", "flex"):
            out, lse = get_executor(name).tiled(
                Inputs(q, k, v, 0.4, valid), SortedWindow(window, causal, sort.order, sort.grouped),
                restrict=KeyRestrictions(exclude_self=shared), rel=relative(rel, Distances(positions=sort.order)),
                need_lse=True)
            seen = lse > -1e30
            loss = (out * torch.linspace(-1, 1, D, dtype=out.dtype)).sum() + torch.where(seen, lse, 0.0).sum()
            wrt = [q, v] + ([] if shared else [k]) + ([] if rel is None else [rel.key, rel.value])
            results.append((out, lse, *torch.autograd.grad(loss, wrt)))
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _table_build(N: int, causal: bool, padding: bool) -> object:
    """The interval block mask of a routing sorted window at N (k = sqrt(N) clusters, window N / k, 8 heads) on
    the meta device."""
    k = round(N ** 0.5)
    clusters = torch.randint(0, k, (1, 8, N), device="meta")
    sort = sort_by_cluster(clusters)
    piece = SortedWindow(N // k, causal, sort.order, sort.grouped)
    whole = torch.ones(1, 8, -(-N // 128), dtype=torch.bool, device="meta") if padding else None
    reach = -(-(piece.window - 1) // 128)
    counts = []
    for _ in range(2):  # the first call also makes the geometry the sizes alone decide (once per size)
        with OperatorCount() as count:
            lo, hi = piece.intervals(own_when_alone=causal)
            blocks.interval_block_mask(lo, hi, (reach, 0 if causal else reach), lambda b, h, i, j: i >= j,
                                       diagonal=not causal, key_blocks_whole=whole)
        counts.append(count)
    return counts


@pytest.mark.parametrize("causal, padding", [(True, False), (False, True)])
def test_the_tables_take_as_many_operators_at_any_length(causal: bool, padding: bool) -> None:
    """65,536 and 262,144 positions: the same operators (a fixed number: 60-70 at a call, the intervals included,
    100 more at the first for a size), none of them near N elements per query block."""
    blocks._GRIDS.clear()
    small, large = _table_build(65536, causal, padding), _table_build(262144, causal, padding)
    assert [c.ops for c in small] == [c.ops for c in large]
    assert sum(large[1].ops.values()) <= 70, large[1].ops
    assert sum(large[0].ops.values()) <= 150, large[0].ops
    assert max(c.largest for c in large) <= 8 * 262144  # the (B, H, N) bounds; the tables are (B, H, N / 128, C)


def test_the_flex_sorted_window_reads_nothing_on_the_host() -> None:
    B, H, N, D = 1, 2, 300, 8
    sort = sort_by_cluster(_clusters(B, H, N, 7, seed=3))
    q, v = torch.randn(B, H, N, D, requires_grad=True), torch.randn(B, H, N, D, requires_grad=True)
    with host_reads(FLEX_EAGER) as reads:  # FlexAttention's own eager operator aside (the GPU compiles it)
        out, _ = get_executor("flex").tiled(Inputs(q, q, v, 0.3), SortedWindow(20, True, sort.order, sort.grouped),
                                            restrict=KeyRestrictions(exclude_self=True))
        out.sum().backward()
    assert not reads.found, reads.report()


@pytest.mark.parametrize("causal", [True, False])
def test_lsh_rounds_leave_out_the_own_key_and_the_pairs_earlier_rounds_hold(monkeypatch, causal: bool) -> None:
    """A round of LSH on the flex executor (``own_key=False``, earlier rounds' labels): the tables list every block
    with an allowed pair and none as full (the labels may leave out any pair), and the rule never allows the
    diagonal nor a pair whose labels are within the window."""
    seen = _recorded(monkeypatch)
    B, H, N, D, window = 1, 2, 150, 4, 9
    sort = sort_by_cluster(_clusters(B, H, N, 5, seed=4))
    labels = torch.randint(0, 40, (B, H, 2, N), generator=torch.Generator().manual_seed(5))
    q, v = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    get_executor("flex").tiled(Inputs(q, q, v, 0.5), SortedWindow(window, causal, sort.order, sort.grouped,
                                                                  own_key=False),
                               restrict=KeyRestrictions(labels=labels, label_window=3))
    (mask_mod, mask, _), = seen
    i, j = torch.arange(N).view(1, 1, N, 1), torch.arange(N).view(1, 1, 1, N)
    allowed = mask_mod(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(H).view(1, H, 1, 1), i, j)
    assert not allowed.diagonal(dim1=-2, dim2=-1).any()
    near = ((labels[..., :, None] - labels[..., None, :]).abs() < 3).any(2)  # (B, H, N, N)
    assert not (allowed & near).any() and allowed.any()
    assert not mask.full_kv_num_blocks.any() and not mask.full_q_num_blocks.any()
    check_interval_tables(mask_mod, mask, (B, H, N), SMALL, exact=False, full=False)
