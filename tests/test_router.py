"""The router alone, and the sorted window's log-sum-exp: several routing rounds merged exactly."""

from __future__ import annotations

import pytest
import torch

from helpers import compare_with_reference, make_router, rand_padding, rand_qkv, rand_rel, routing_layer
from routeformer.attention.routing import Router, RoutingOptions, update_routing
from routeformer.attention.routing.sorted_window import sort_by_cluster, sorted_window_attention, sorted_window_mask
from routeformer.executors import Inputs, get_executor, merge_partials, neg_inf

EXECUTOR = get_executor("auto", "cpu")


@pytest.mark.parametrize("shared, separate", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("probes, balance", [(1, 0.0), (3, 0.01)])
def test_a_router_alone_routes_observes_and_updates_as_the_layer_does(shared: bool, separate: bool, probes: int,
                                                                      balance: float) -> None:
    B, H, N, D, k = 2, 3, 30, 8, 4
    options = dict(shared_qk=shared, separate=separate, probes=probes, balance=balance, seed=3)
    router = make_router(H, D, k, **options).double()
    # the layer on the tiles executor: PyTorch's operators, as the router alone routes, bit for bit (the fused
    # kernels sum the vectors in another order: test_fused_route.py and test_fused_vectors.py compare those)
    layer = routing_layer(H, D, k, 5, backend="tiles", **options).double()
    assert isinstance(layer.routing, Router)
    q, kk, v = rand_qkv(B, H, N, D, grad=False)
    kk = q if shared else kk
    assert torch.equal(router.route(q, kk), layer.routing.route(q, kk))
    assert torch.equal(router.route_keys(q, kk), layer.routing.route_keys(q, kk))
    routes = router.routes(q, kk, observe=True)
    assert routes.scores.shape == (B, H, N, k) and routes.probes.shape == (B, H, N, probes)
    assert torch.equal(routes.keys, router.route_keys(q, kk)) and torch.equal(routes.probes, router.probe(q, kk))
    assert torch.equal(routes.probes[..., 0], router.route(q, kk))
    assert torch.equal(routes.probes[..., 0], routes.keys) != separate  # separate: queries route apart
    assert (routes.probes.sort(-1).values.diff(dim=-1) > 0).all(), "probed clusters are distinct"
    layer(q, kk, v)
    assert torch.equal(router.commitment_loss, layer.commitment_loss)
    assert router.kmeans.pending_counts.sum() == H * B * N  # the centroids follow the keys alone
    if balance:
        assert router.pending_load.sum() == H * B * N  # the loads count keys
    assert update_routing(torch.nn.ModuleList([router, layer])) == 2
    assert torch.equal(router.kmeans.centroids, layer.routing.kmeans.centroids)
    assert bool(router.kmeans.initialized)
    if balance:
        assert torch.equal(router.bias, layer.routing.bias) and router.bias.abs().sum() > 0


def test_separate_routing_probes_clusters_that_hold_keys_where_queries_and_keys_point_apart() -> None:
    """Queries near -e_1 and keys near +e_1 (W_Q and W_K pointing apart): centroids that followed the queries too
    would split into query-only and key-only clusters, and every query would probe a cluster holding no key (a dead
    head: issue 70's separately routed run). Following the keys, every query's cluster holds keys."""
    B, H, N, D, k = 2, 2, 64, 8, 4
    router = make_router(H, D, k, shared_qk=False, separate=True, seed=1).double()
    gen = torch.Generator().manual_seed(0)
    direction = torch.zeros(D, dtype=torch.float64)
    direction[0] = 1.0
    for _ in range(5):  # routing vectors are turned by W_R: the two clouds stay opposite after it
        kk = direction + 0.3 * torch.randn(B, H, N, D, dtype=torch.float64, generator=gen)
        q = -direction + 0.3 * torch.randn(B, H, N, D, dtype=torch.float64, generator=gen)
        router.routes(q, kk, observe=True)
        router.update()
    routes = router.routes(q, kk)
    for b in range(B):
        for h in range(H):
            held = set(routes.keys[b, h].tolist())
            assert set(routes.probes[b, h, :, 0].tolist()) <= held, "a query probes a cluster with no key"


def test_probes_are_the_best_clusters_by_biased_score_own_cluster_first() -> None:
    """Built independently: a key's cluster is the argmax of cosine + bias, a query's probes its p best clusters
    by the same score, distinct, its own first."""
    B, H, N, D, k, p = 2, 2, 40, 8, 6, 3
    router = make_router(H, D, k, probes=p, balance=0.05).double()
    with torch.no_grad():
        router.bias.copy_(torch.randn(H, k, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 0.3)
    q, _, _ = rand_qkv(B, H, N, D, grad=False)
    r = torch.nn.functional.normalize(q, dim=-1) @ router.projection  # (B, H, N, D) with W_R per head
    score = r @ router.kmeans.centroids.transpose(-1, -2) + router.bias[:, None, :]
    plain = (r @ router.kmeans.centroids.transpose(-1, -2)).argmax(-1)
    routes = router.routes(q, q)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                ranked = sorted(range(k), key=lambda c, b=b, h=h, i=i: -float(score[b, h, i, c]))
                assert routes.keys[b, h, i] == ranked[0]
                assert routes.probes[b, h, i].tolist() == ranked[:p]
    assert not torch.equal(routes.keys, plain), "the bias changes some assignments"
    # the scores the routing used come back whole (the search for the next probes masks winners and restores them)
    torch.testing.assert_close(routes.scores, score, rtol=0, atol=1e-12)


def test_tied_scores_probe_the_lower_cluster_first() -> None:
    router = make_router(1, 4, 5, probes=3)
    scores = torch.tensor([[[[0.5, 0.9, 0.2, 0.9, 0.5]]]])  # (B, H, N, k): two ties
    assert router._best(scores.clone()).tolist() == [[[[1, 3, 0]]]]


def test_the_bias_steps_towards_equal_loads_between_optimiser_steps() -> None:
    """b_c += rate · sign(mean load - load_c), loads counted over the real keys of the training forwards since the
    last step; nothing moves in evaluation mode or without a forward."""
    H, D, k, rate = 2, 8, 4, 0.25
    router = make_router(H, D, k, balance=rate).double()
    q, _, _ = rand_qkv(3, H, 50, D, grad=False)
    padding = torch.rand(3, 50, generator=torch.Generator().manual_seed(4)) > 0.4
    keys = router.routes(q, q).keys
    router.routes(q, q, padding, observe=True)
    router.routes(q[:1], q[:1], observe=True)  # a second micro-batch
    load = torch.zeros(H, k, dtype=torch.float64)
    for b in range(3):
        for h in range(H):
            for j in range(50):
                load[h, keys[b, h, j]] += float(padding[b, j]) + (b == 0)
    assert torch.equal(router.pending_load, load)
    router.update()
    assert torch.equal(router.bias, rate * torch.sign(load.mean(-1, keepdim=True) - load))
    router.eval()
    router.routes(q, q, observe=True)
    before = router.bias.clone()
    router.update()
    router.train()
    router.update()
    assert torch.equal(router.bias, before)


def test_a_balanced_router_spreads_keys_that_one_cluster_would_take() -> None:
    """The centroids are seeded on spread-out vectors; then every vector comes from around one new direction, which
    one centroid is nearest to: under the plain argmax it takes almost every key (the others keep nothing, so
    k-means never moves them). The bias, stepping once per forward, spreads the keys: the largest cluster ends
    near the mean size."""
    torch.manual_seed(0)
    H, D, k = 1, 8, 4
    plain, balanced = make_router(H, D, k).double(), make_router(H, D, k, balance=0.01).double()
    spread, direction = torch.randn(8, H, 64, D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)

    def batch():
        return direction + 0.3 * torch.randn(8, H, 64, D, dtype=torch.float64)

    for router in (plain, balanced):
        router.routes(spread, spread, observe=True)
        router.update()  # seeds the centroids
        for _ in range(300):
            x = batch()
            router.routes(x, x, observe=True)
            router.update()
    x = batch()

    def largest(router):
        sizes = torch.nn.functional.one_hot(router.routes(x, x).keys, k).sum((0, 2)).double()
        return float(sizes.max() / sizes.mean())

    assert largest(plain) > 2.5 and largest(balanced) < 1.5, (largest(plain), largest(balanced))


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
    inputs, options = Inputs(q, k, v, D**-0.5, valid), RoutingOptions(window=w, shared_qk=False)
    sort = sort_by_cluster(clusters)
    out, lse = sorted_window_attention(inputs, sort, options, executor=EXECUTOR, causal=causal, rel_pos=rel,
                                       need_lse=True)
    assert torch.equal(out, sorted_window_attention(inputs, sort, options, executor=EXECUTOR, causal=causal,
                                                    rel_pos=rel))
    mask = sorted_window_mask(clusters, w, causal, False, valid)
    want = _scores(q, k, D**-0.5, rel).masked_fill(~mask, float("-inf")).logsumexp(-1)
    seen = mask.any(-1)
    assert lse.shape == (B, H, N) and lse.dtype == torch.float64
    torch.testing.assert_close(lse[seen], want[seen], rtol=1e-10, atol=1e-10)
    assert (lse[~seen] == neg_inf(lse.dtype)).all()
    assert (~seen).any() == (extras == "padding")


def _two_rounds(q, k, v, first, second, *, window, causal, exclude_self, key_padding_mask=None, rel_pos=None):
    valid = None if key_padding_mask is None else key_padding_mask[:, None, :]
    inputs = Inputs(q, k, v, q.shape[-1] ** -0.5, valid)
    options = RoutingOptions(window=window, shared_qk=exclude_self)
    parts = [sorted_window_attention(inputs, sort_by_cluster(c), options, executor=EXECUTOR, causal=causal,
                                     rel_pos=rel_pos, need_lse=True) for c in (first, second)]
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


def test_turn_and_its_gradient_are_normalise_then_project() -> None:
    """``turn`` (normalise, then W_R, with a backward of its own) against F.normalize and an einsum under autograd,
    float64: the same vectors and gradient, also for a zero vector and one shorter than F.normalize's eps (which it
    divides by eps), and gradcheck."""
    import torch.nn.functional as F

    from routeformer.attention.routing.router import turn

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 17, 8, dtype=torch.float64, generator=g)
    x[0, 1, 4], x[1, 2, 5] = 0.0, 1e-14
    x.requires_grad_()
    projection = torch.linalg.qr(torch.randn(3, 8, 8, dtype=torch.float64, generator=g))[0]
    grad = torch.randn(2, 3, 17, 8, dtype=torch.float64, generator=g)
    got = turn(x, projection)
    want = torch.einsum("bhnd,hde->bhne", F.normalize(x, dim=-1), projection)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0],
                               rtol=1e-12, atol=1e-12)
    y = torch.randn(1, 3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: turn(t, projection), (y,))


@pytest.mark.parametrize("chunk", [1, 3 * 2 * 2 * 40, 1 << 24])
@pytest.mark.parametrize("biased", [False, True])
def test_balanced_members_in_chunks_of_clusters_are_the_whole_scores(monkeypatch, chunk: int, biased: bool) -> None:
    """``Router.members`` (a few clusters' scores at a time: one cluster a chunk, three, all) is
    ``balanced_members`` over the router's whole (B, H, N, k) scores, padding and the bias included."""
    from routeformer.attention.routing import router as router_module
    from routeformer.attention.routing.balanced import balanced_members

    monkeypatch.setattr(router_module, "MEMBER_CHUNK", chunk)
    router = Router(2, 8, RoutingOptions(num_clusters=7, window=6, probes=1, balance=0.01 if biased else 0.0))
    router = router.double()
    if biased:
        router.bias.copy_(torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 0.1)
    q, _, _ = rand_qkv(2, 2, 40, 8, grad=False)
    pad = rand_padding(2, 40, seed=5)
    routes = router.routes(q, q, pad)
    want = balanced_members(routes.scores, 6, pad)
    assert torch.equal(router.members(routes.vectors, 6, pad), want)


def test_a_balanced_layer_makes_no_scores_tensor(monkeypatch) -> None:
    """A balanced (non-causal) routing layer's training forward and backward on the fused executor makes no
    floating-point tensor of half the (B, H, N, k) scores' size: the router's kernel routes, and the members are
    scored a few clusters at a time (before: the whole scores, B · H · N · k)."""
    from helpers import OperatorCount
    from routeformer.attention.routing import RoutingAttention
    from routeformer.attention.routing import router as router_module

    B, H, N, D, k = 1, 2, 512, 8, 32
    layer = RoutingAttention(H, D, RoutingOptions(num_clusters=k, window=N // k, probes=1, balance=0.0),
                             causal=False, balanced=True).double().train()
    layer.executor = get_executor("fused")
    q, _, v = rand_qkv(B, H, N, D)
    monkeypatch.setattr(router_module, "MEMBER_CHUNK", B * H * N * 4)
    with OperatorCount() as count:
        out = layer(q, q, v)
        (out.square().sum() + layer.routing.commitment_loss).backward()
    assert count.largest_float < B * H * N * k // 2, count.largest_float
