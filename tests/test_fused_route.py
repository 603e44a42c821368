"""The fused router (``routeformer_fused::route``, executors/fused/routes.py) against the PyTorch router it stands in
for: the same probes, key clusters, sort by (cluster, position) and k-means statistics in float64; in float32 every
pick within rounding of the best score; the same bits for every thread count; errors that name the argument; and a
routing layer's training forward and gradients the same on both paths."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers import rand_padding
from routeformer.attention.routing import RoutingAttention
from routeformer.attention.routing.options import RoutingOptions
from routeformer.attention.routing.router import Router
from routeformer.attention.routing.sorted_window import sort_by_cluster
from routeformer.executors import get_executor
from routeformer.executors.fused import available
from routeformer.executors.fused.routes import fused_route

pytestmark = pytest.mark.skipif(not available(), reason="the fused kernels are not built here")


def _unit(*shape: int, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1).to(dtype)


def _scores(r, centroids, bias):
    s = torch.einsum("bhnd,hkd->bhnk", r, centroids)
    return s if bias is None else s + bias[:, None, :]


def _best(s: torch.Tensor, p: int) -> torch.Tensor:
    """The definition: p passes of argmax, each winner masked."""
    s, found = s.clone(), []
    for _ in range(p):
        found.append(s.argmax(-1))
        s.scatter_(-1, found[-1][..., None], float("-inf"))
    return torch.stack(found, -1)


CASES = [(1, 7, False, False, 1), (2, 16, True, True, 2), (3, 19, True, False, 37), (1, 128, False, True, 130)]


@pytest.mark.parametrize("probes, k, with_bias, padded, N", CASES)
def test_the_routes_are_the_definitions_in_float64(probes, k, with_bias, padded, N) -> None:
    B, H, D = 2, 3, 12
    r = _unit(B, H, N, D, seed=1)
    centroids = _unit(H, k, D, seed=2)
    bias = 0.05 * torch.randn(H, k, generator=torch.Generator().manual_seed(3), dtype=torch.float64) \
        if with_bias else None
    valid = rand_padding(B, N, seed=4) if padded else None
    got = fused_route(r, centroids, bias, valid, probes, observe=True)
    want = _best(_scores(r, centroids, bias), probes)
    assert torch.equal(got.probes, want)
    keys = want[..., 0]
    sort = sort_by_cluster(keys, k)
    for name in ("order", "inverse", "grouped", "counts"):
        assert torch.equal(getattr(got, name), getattr(sort, name)), name
    w = torch.ones(B, N, dtype=torch.float64) if valid is None else valid.double()
    onehot = F.one_hot(keys, k).double() * w[:, None, :, None]  # (B, H, N, k)
    torch.testing.assert_close(got.weights, onehot.sum((0, 2)), rtol=0, atol=0)
    torch.testing.assert_close(got.sums, torch.einsum("bhnk,bhnd->hkd", onehot, r), rtol=1e-12, atol=1e-12)
    cosines = torch.einsum("bhnd,hkd->bhnk", r, centroids).gather(-1, keys[..., None])[..., 0]  # without the bias
    torch.testing.assert_close(got.cosine, cosines, rtol=1e-12, atol=1e-12)
    unobserved = fused_route(r, centroids, bias, valid, probes, observe=False)
    assert unobserved.sums.numel() == 0 and unobserved.weights.numel() == 0
    assert torch.equal(unobserved.probes, got.probes) and torch.equal(unobserved.order, got.order)


def test_ties_keep_the_lower_cluster_and_nan_or_minus_inf_is_never_picked() -> None:
    """Clusters past the kernel's vector width (k = 40: the four-vector passes and single vectors; the scalar tail is
    the k = 7 and 19 cases' above): an exact tie between two clusters
    (a centroid repeated) keeps the lower one first, a cluster whose bias is -inf or NaN is never picked while another
    can be, as the definition's argmax over the scores with those clusters at -inf."""
    B, H, N, D, k, p = 1, 2, 64, 8, 40, 3
    r = _unit(B, H, N, D, seed=13)
    centroids = _unit(H, k, D, seed=14)
    centroids[:, 33] = centroids[:, 5]  # a tie at the best: 5 first, then 33
    centroids[:, 38] = centroids[:, 21]
    centroids[:, 17] = r[0, :, 0]  # position 0's best by far, but barred below
    bias = torch.zeros(H, k, dtype=torch.float64)
    bias[:, 17] = float("-inf")
    bias[:, 29] = float("nan")
    got = fused_route(r, centroids, bias, None, p, observe=False)
    scores = _scores(r, centroids, bias)
    scores[..., 33], scores[..., 38] = scores[..., 5], scores[..., 21]  # einsum may round a repeated centroid apart
    want = _best(torch.where(scores.isnan(), float("-inf"), scores), p)
    assert torch.equal(got.probes, want)
    slot = torch.arange(p).expand_as(got.probes)
    at5, at33 = (torch.where(got.probes == c, slot, p).amin(-1) for c in (5, 33))
    assert (at33 < p).any() and (at5[at33 < p] == at33[at33 < p] - 1).all()  # the tie met: 5 just before 33
    assert not ((got.probes == 17) | (got.probes == 29)).any()


def test_float32_picks_are_within_rounding_of_the_best() -> None:
    B, H, N, D, k, p = 2, 2, 300, 32, 16, 2
    r = _unit(B, H, N, D, dtype=torch.float32, seed=5)
    centroids = _unit(H, k, D, dtype=torch.float32, seed=6)
    got = fused_route(r, centroids, None, None, p, observe=False)
    exact = _scores(r.double(), centroids.double(), None)
    want = _best(exact, p)
    chosen = exact.gather(-1, got.probes)
    best = exact.gather(-1, want)
    assert (best - chosen).abs().max() < 1e-5  # a flip only where two scores tie to float32's rounding
    assert (got.probes == want).double().mean() > 0.99
    assert torch.equal(got.order, sort_by_cluster(got.probes[..., 0]).order)


def test_the_same_bits_for_every_thread_count() -> None:
    r = _unit(2, 2, 517, 24, dtype=torch.float32, seed=7)
    centroids = _unit(2, 11, 24, dtype=torch.float32, seed=8)
    bias = torch.randn(2, 11, generator=torch.Generator().manual_seed(9)) * 0.01
    valid = rand_padding(2, 517, seed=10)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(fused_route(r, centroids, bias, valid, 3, observe=True))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)  # the cosine: None from this kernel


def test_errors_name_the_argument() -> None:
    r = _unit(1, 2, 8, 4)
    centroids = _unit(2, 3, 4)
    route = torch.ops.routeformer_fused.route
    with pytest.raises(RuntimeError, match=r"route: probes \(4\) must be at most the number of clusters k \(3\)"):
        route(r, centroids, None, None, 4, False)
    with pytest.raises(RuntimeError, match=r"route: centroids must be \(H, k, D\)"):
        route(r, centroids[:1], None, None, 1, False)
    with pytest.raises(RuntimeError, match=r"route: centroids must be Double"):
        route(r, centroids.float(), None, None, 1, False)
    with pytest.raises(RuntimeError, match=r"route: bias must be \(H, k\)"):
        route(r, centroids, torch.zeros(2, 4, dtype=torch.float64), None, 1, False)
    with pytest.raises(RuntimeError, match=r"route: key_valid must be"):
        route(r, centroids, None, torch.ones(1, 2, 8, dtype=torch.bool), 1, False)


@pytest.mark.parametrize("probes, balance, separate", [(1, 0.0, False), (2, 0.01, False), (2, 0.01, True),
                                                       (1, 0.0, True)])
def test_a_routing_layer_trains_the_same_on_both_routers(monkeypatch, probes: int, balance: float,
                                                         separate: bool) -> None:
    """Two training forwards and backwards of a causal routing layer (float64, padding, relative positions
    absent), the fused router (its vectors and its choice) against PyTorch's: the same output, gradients (the
    commitment term's through the vectors included), k-means statistics, loads and commitment loss; and the
    centroids' first update (the seeding from the kept samples) the same. Separate routing (queries by q, keys by
    k): the kernel routes the keys and, in a second call, the queries."""
    B, H, N, D = 2, 2, 40, 8
    options = RoutingOptions(num_clusters=5, window=6, probes=probes, balance=balance, separate=separate,
                             shared_qk=not separate)
    layers = [RoutingAttention(H, D, options).double().train() for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    pad = rand_padding(B, N, seed=12)
    results = []
    fused = get_executor("fused")
    unrouted = dataclasses.replace(fused, route_run=None, vectors_run=None)
    for executor, layer in zip((fused, unrouted), layers, strict=True):
        layer.executor = executor  # the same attention, routed by the kernel and by PyTorch's operators
        outs = []
        for _ in range(2):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            out = layer(x[0], x[1] if separate else x[0], x[2], key_padding_mask=pad)  # shared QK: k = q
            loss = out.square().sum() + layer.routing.commitment_loss
            loss.backward()
            state = {name: b.clone() for name, b in layer.named_buffers()}
            outs.append((out.detach(), [t.grad for t in x], layer.routing.commitment_loss.detach(), state))
            layer.update()
        results.append(outs)
    for (o1, g1, c1, s1), (o2, g2, c2, s2) in zip(*results, strict=True):
        torch.testing.assert_close(o1, o2, rtol=1e-12, atol=1e-12)
        for a, b in zip(g1, g2, strict=True):
            if a is None or b is None:
                assert a is None and b is None
            else:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(c1, c2, rtol=1e-12, atol=0)
        assert s1.keys() == s2.keys()
        for name in s1:
            torch.testing.assert_close(s1[name], s2[name], rtol=1e-12, atol=1e-12, msg=name)


def test_the_fused_router_is_taken_where_the_kernels_take_the_vectors() -> None:
    """A causal forward on the CPU's executor routes through its fused kernel (no (B, H, N, k) scores); the
    balanced (non-causal) clusters, which read the scores, keep PyTorch's, and so does the tiles executor, which
    has no router of its own (``backend="tiles"`` runs no C++)."""
    calls = []
    fused = get_executor("fused")
    counted = dataclasses.replace(fused, route_run=lambda *a: calls.append(1) or fused_route(*a))
    router = Router(2, 8, RoutingOptions(num_clusters=4, window=4, probes=1, balance=0.0)).double()
    q = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    routes = router.routes(q, q, need_scores=False, executor=counted)
    assert calls and routes.scores is None and routes.sort is not None
    assert torch.equal(routes.sort.order, sort_by_cluster(routes.keys).order)
    calls.clear()
    full = router.routes(q, q, executor=counted)
    assert not calls and full.scores is not None and full.sort is None and torch.equal(full.keys, routes.keys)
    assert get_executor("tiles").route_run is None
    by_tiles = router.routes(q, q, need_scores=False, executor=get_executor("tiles"))
    assert by_tiles.sort is None and torch.equal(by_tiles.keys, routes.keys)
    # separate routing: two calls, the keys' clusters by k's vectors and the queries' probes by q's
    separate = Router(2, 8, RoutingOptions(num_clusters=4, window=4, probes=2, balance=0.0, separate=True,
                                           shared_qk=False)).double()
    k = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    calls.clear()
    routes = separate.routes(q, k, need_scores=False, executor=counted)
    assert len(calls) == 2 and routes.scores is None and routes.sort is not None
    full = separate.routes(q, k, executor=counted)
    assert len(calls) == 2 and torch.equal(full.keys, routes.keys) and torch.equal(full.probes, routes.probes)
    assert not torch.equal(routes.probes[..., 0], routes.keys)  # the queries' own choice, not their keys' cluster
