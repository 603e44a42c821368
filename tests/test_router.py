"""The router alone, and the sorted window's log-sum-exp: several routing rounds merged exactly."""

from __future__ import annotations

import pytest
import torch

from helpers import compare_with_reference, rand_padding, rand_qkv, rand_rel
from routeformer.attention import RoutingAttention
from routeformer.attention.executors import merge_partials, neg_inf
from routeformer.attention.routing import Router, update_routing
from routeformer.attention.routing.sorted_window import sorted_window_attention, sorted_window_mask


@pytest.mark.parametrize("shared, separate", [(True, False), (False, False), (False, True)])
def test_a_router_alone_routes_observes_and_updates_as_the_layer_does(shared: bool, separate: bool) -> None:
    B, H, N, D, k = 2, 3, 30, 8, 4
    router = Router(H, D, k, shared_qk=shared, separate=separate, seed=3).double()
    layer = RoutingAttention(H, D, k, 5, shared_qk=shared, separate=separate, seed=3).double()
    assert isinstance(layer, Router)
    q, kk, v = rand_qkv(B, H, N, D, grad=False)
    kk = q if shared else kk
    assert torch.equal(router.route(q, kk), layer.route(q, kk))
    assert torch.equal(router.route_keys(q, kk), layer.route_keys(q, kk))
    events = 2 * N if separate else N
    scores, clusters = router.assign_and_observe(q, kk)
    assert scores.shape == (B, H, events, k) and torch.equal(clusters, router.assign(q, kk))
    layer(q, kk, v)
    assert torch.equal(router.commitment_loss, layer.commitment_loss)
    assert router.kmeans.pending_counts.sum() == H * B * events
    assert update_routing(torch.nn.ModuleList([router, layer])) == 2
    assert torch.equal(router.kmeans.centroids, layer.kmeans.centroids)
    assert bool(router.kmeans.initialized)


def _scores(q, k, scale, rel):
    """(B, H, N, N) float64 scores q·k / sqrt(D) with the relative key term (distances between positions)."""
    s = q @ k.transpose(-1, -2) * scale
    if rel is not None:
        pos = torch.arange(q.shape[2])
        a_key, _ = rel.tables(pos[None, :] - pos[:, None], q.dtype)  # (N, N, D)
        s = s + (q[:, :, :, None, :] * a_key).sum(-1) * scale
    return s


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("extras", ["plain", "relative", "padding"])
def test_sorted_window_lse_is_the_logsumexp_of_each_query_in_position_order(causal: bool, extras: str) -> None:
    B, H, N, D, w = 2, 2, 33, 8, 4
    q, k, v = rand_qkv(B, H, N, D)
    clusters = torch.randint(0, 3, (B, H, N), generator=torch.Generator().manual_seed(1))
    rel = rand_rel(D, 5) if extras == "relative" else None
    padding = rand_padding(B, N) if extras == "padding" else None
    valid = None if padding is None else padding[:, None, :]
    out, lse = sorted_window_attention(q, k, v, clusters, window=w, causal=causal, exclude_self=False,
                                       scale=D**-0.5, key_valid=valid, rel_pos=rel, need_lse=True)
    assert torch.equal(out, sorted_window_attention(q, k, v, clusters, window=w, causal=causal, exclude_self=False,
                                                    scale=D**-0.5, key_valid=valid, rel_pos=rel))
    mask = sorted_window_mask(clusters, w, causal, False, valid)
    want = _scores(q, k, D**-0.5, rel).masked_fill(~mask, float("-inf")).logsumexp(-1)
    seen = mask.any(-1)
    assert lse.shape == (B, H, N) and lse.dtype == torch.float64
    torch.testing.assert_close(lse[seen], want[seen], rtol=1e-10, atol=1e-10)
    assert (lse[~seen] == neg_inf(lse.dtype)).all()
    assert (~seen).any() == (extras == "padding")


def _two_rounds(q, k, v, first, second, *, window, causal, exclude_self, key_padding_mask=None, rel_pos=None):
    valid = None if key_padding_mask is None else key_padding_mask[:, None, :]
    parts = [sorted_window_attention(q, k, v, c, window=window, causal=causal, exclude_self=exclude_self,
                                     scale=q.shape[-1] ** -0.5, key_valid=valid, rel_pos=rel_pos, need_lse=True)
             for c in (first, second)]
    return merge_partials(parts)[0]


@pytest.mark.parametrize("window", [2, 3, 8])
def test_two_rounds_with_disjoint_keys_merge_into_attention_over_the_union_of_their_masks(window: int) -> None:
    """Round one groups positions by i // m, round two by i % m (under random group labels): two positions share a
    group in both rounds only if they are the same position, and shared QK drops a query's own key (every group has
    another member within the window), so no (query, key) pair is in both rounds and the merge is exact."""
    B, H, m, D = 2, 2, 6, 8
    N = m * 5
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(N)
    first = torch.stack([torch.randperm(N, generator=g)[pos // m] for _ in range(B * H)]).view(B, H, N)
    second = torch.stack([torch.randperm(N, generator=g)[pos % m] for _ in range(B * H)]).view(B, H, N)
    q, _, v = rand_qkv(B, H, N, D)
    masks = [sorted_window_mask(c, window, False, True) for c in (first, second)]
    assert not (masks[0] & masks[1]).any() and (masks[0] | masks[1]).sum(-1).min() >= 2
    rel = rand_rel(D, 7)
    compare_with_reference(lambda q_, k_, v_, **kw: _two_rounds(q_, q_, v_, first, second, window=window,
                                                                causal=False, exclude_self=True, **kw),
                           masks[0] | masks[1], q, q, v, rel_pos=rel)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_rounds_count_a_key_once_per_round_that_holds_it(causal: bool, seed: int) -> None:
    """With overlapping rounds the merge is softmax over the multiset union: key j's weight is multiplied by the
    number of rounds c_ij whose window holds it (score + log c_ij), as documented; exact once-counting would
    subtract log c_ij."""
    B, H, N, D, w = 2, 2, 29, 8, 4
    g = torch.Generator().manual_seed(seed)
    first, second = (torch.randint(0, 3, (B, H, N), generator=g) for _ in range(2))
    q, _, v = rand_qkv(B, H, N, D, seed=seed)
    padding = rand_padding(B, N, seed=seed)
    valid = padding[:, None, :]
    count = sum(sorted_window_mask(c, w, causal, True, valid).double() for c in (first, second))
    assert (count == 2).any() and (count == 1).any()
    got = _two_rounds(q, q, v, first, second, window=w, causal=causal, exclude_self=True, key_padding_mask=padding)
    weights = count * (_scores(q, q, D**-0.5, None) - _scores(q, q, D**-0.5, None).amax(-1, keepdim=True)).exp()
    probs = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    want = probs @ v
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, [q, v], grad), torch.autograd.grad(want, [q, v], grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
