"""The routing rule's options beyond the paper's argmax: the gates over several probes and the dense warm-up, at the
layer and in a model (the probes and the bias: test_router.py, test_routing.py, test_routing_decode.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import rand_qkv, rand_rel, routing_layer
from routeformer import TransformerConfig, TransformerLM
from routeformer.attention import Inputs, KeyStore, RoutingAttention, RoutingCache, reference_attention
from routeformer.attention.reference import reference_weights
from routeformer.attention.routing import RoutingOptions
from routeformer.attention.routing import probes as probes_module
from routeformer.attention.routing.probes import probe_masks
from routeformer.attention.routing.sorted_window import sort_by_cluster
from routeformer.executors import get_executor
from routeformer.executors.fused import available as fused_available


def _layer(**kw) -> RoutingAttention:
    layer = routing_layer(2, 8, 4, 5, causal=True, balance=0.01, **kw).double()
    with torch.no_grad():
        layer.routing.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    return layer


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_gates_weigh_each_probed_cluster_by_the_query_softmax_over_its_centroids(shared: bool, dense: bool,
                                                                                monkeypatch) -> None:
    """Written out independently: g_t = softmax(8 · cos(r_q, μ))[P_t], each probe's keys normalised apart; on the
    dense tile of short sequences and on the ranges of longer ones."""
    monkeypatch.setattr(probes_module, "DENSE_UP_TO", 10**9 if dense else 0)
    B, H, N, D = 2, 2, 40, 8
    layer = _layer(shared_qk=shared, probes=3, gate=True)
    q, k, v = rand_qkv(B, H, N, D)
    k = q if shared else k
    rel = rand_rel(D, 6)
    out = layer(q, k, v, rel_pos=rel)
    r = F.normalize(q if shared else F.normalize(q, dim=-1) + F.normalize(k, dim=-1), dim=-1) @ layer.routing.projection
    gates = (8 * r @ layer.routing.kmeans.centroids.transpose(-1, -2)).softmax(-1)  # (B, H, N, k)
    probes = layer.routing.probe(q, k)
    masks = probe_masks(layer.routing.route_keys(q, k), probes, 5)  # (B, H, p, N, N)
    if shared:
        eye = torch.eye(N, dtype=torch.bool)
        masks = masks & ~(eye & (masks.any(2) & ~eye).any(-1, keepdim=True))[:, :, None]
    want = sum(gates.gather(-1, probes)[..., t, None] * reference_attention(Inputs.of(q, k, v), masks[:, :, t], rel=rel)
               for t in range(3))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    # The gates are a path for the gradient into the routing: q's gradient changes when they are held constant.
    (grad,) = torch.autograd.grad(out.square().sum(), q)
    held = want.detach() - sum(
        (gates.gather(-1, probes)[..., t, None] - gates.gather(-1, probes)[..., t, None].detach())
        * reference_attention(Inputs.of(q, k, v), masks[:, :, t], rel=rel) for t in range(3))
    assert not torch.allclose(grad, torch.autograd.grad(held.square().sum(), q)[0])


def _dense(q, k, v, shared, rel=None):
    n = q.shape[2]
    allow = torch.ones(n, n, dtype=torch.bool).tril()
    if shared:  # not the own key, unless it is the only one (position 0)
        allow = allow & ~(torch.eye(n, dtype=torch.bool) & (torch.arange(n) > 0)[:, None])
    return reference_attention(Inputs.of(q, k, v), allow, rel=rel)


@pytest.mark.parametrize("shared", [True, False])
def test_the_warm_up_attends_densely_for_its_steps_and_the_routing_learns_all_along(shared: bool) -> None:
    layer = _layer(shared_qk=shared, probes=2, warmup=3)
    q, k, v = rand_qkv(2, 2, 30, 8)
    k = q if shared else k
    rel = rand_rel(8, 5)
    for step in range(3):
        assert layer.warming_up and int(layer.routing.steps) == step
        for mode in (layer.train, layer.eval):  # the model is a function of its state, not of its mode
            mode()
            torch.testing.assert_close(layer(q, k, v, rel_pos=rel), _dense(q, k, v, shared, rel), rtol=1e-10,
                                       atol=1e-10)
        layer.train()
        layer(q, k, v)
        # observed all the same
        assert layer.routing.kmeans.pending_counts.sum() > 0 and layer.routing.pending_load.sum() > 0
        bias = layer.routing.bias.clone()
        layer.update()
        assert not torch.equal(bias, layer.routing.bias)
    assert not layer.warming_up
    routed = layer(q, k, v, rel_pos=rel)
    torch.testing.assert_close(routed, reference_attention(Inputs.of(q, k, v), layer.routing_mask(q, k), rel=rel))
    assert not torch.allclose(routed, _dense(q, k, v, shared, rel))
    # The count is model state: a layer loaded from it routes at once.
    fresh = routing_layer(2, 8, 4, 5, causal=True, shared_qk=shared, balance=0.01, probes=2, warmup=3).double()
    assert fresh.warming_up
    fresh.load_state_dict(layer.state_dict())
    assert not fresh.warming_up
    torch.testing.assert_close(fresh(q, k, v, rel_pos=rel), routed, rtol=0, atol=0)


def test_a_layer_in_its_warm_up_has_no_routed_cache() -> None:
    """During the warm-up a layer's cache keeps every position (as a model's does), so it needs max_len."""
    layer = routing_layer(2, 8, 4, 5, warmup=2)
    assert isinstance(layer.new_cache(1, 10), KeyStore)
    with pytest.raises(ValueError, match="attends densely for 2 more optimiser steps"):
        layer.new_cache(1, None)


def test_a_model_decodes_exactly_during_and_after_the_warm_up() -> None:
    """During the warm-up the routing heads keep every position (as full attention does); after it, the routed
    ring buffers. Either way decoding reproduces the forward."""
    config = TransformerConfig(vocab_size=32, dim=32, depth=2, heads=4, seq_len=40, attention="local:2,routing:2",
                               rel_clip=6, options={"local": {"window": 6}, "routing": {
                                   "num_clusters": 4, "window": 5, "probes": 2, "balance": 0.05, "warmup": 2}})
    kinds, _ = _decode_through_training_steps(config, 3)
    assert kinds == [KeyStore, KeyStore, RoutingCache]


def _decode_through_training_steps(config: TransformerConfig, steps: int) -> tuple[list[type], list[torch.Tensor]]:
    """Before each of ``steps`` training steps: decoding (a prompt of 9, then one token at a time) reproduces the
    forward. Returns the routing layer's cache type and the forward's logits at each."""
    torch.manual_seed(0)
    model = TransformerLM(config).double()
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)
    tokens = torch.randint(0, 32, (2, 40), generator=torch.Generator().manual_seed(1))
    kinds, outs = [], []
    for _ in range(steps):
        model.eval()
        full = model(tokens)
        outs.append(full)
        cache = model.new_cache(2, 40)
        kinds.append(type(cache.layers[0].groups[1]))
        parts = [model(tokens[:, :9], cache)] + [model(tokens[:, i:i + 1], cache) for i in range(9, 40)]
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-9)
        model.train()
        (model(tokens).sum() + model.aux_loss).backward()
        model.after_optimizer_step()
    return kinds, outs


def test_training_flops_count_the_dense_warm_up() -> None:
    base = dict(vocab_size=32, dim=32, depth=2, heads=4, seq_len=64, attention="local:2,routing:2", rel_clip=8)
    routing = dict(num_clusters=8, window=8, probes=2)
    plain, warm = (TransformerLM(TransformerConfig(**base, options={"local": {"window": 8}, "routing": {
        **routing, "warmup": w}})) for w in (0, 10))
    assert warm.flops_per_token(step=10) == plain.flops_per_token() == plain.flops_per_token(step=0)
    dense_keys = (64 + 1) / 2 + 8  # every earlier key, and the routing
    routed_keys = 2 * 8 + 8
    extra = 3 * 4 * 8 * 2 * 2 * (dense_keys - routed_keys)  # ×3 training, 4·D per key, 2 heads, 2 layers
    assert warm.flops_per_token(step=9) - plain.flops_per_token() == pytest.approx(extra)
    assert warm.training_flops(30, 100) == pytest.approx(plain.training_flops(30, 100) + 10 * 100 * extra)
    assert warm.training_flops(5, 100) == pytest.approx(plain.training_flops(5, 100) + 5 * 100 * extra)


def test_a_warm_up_at_a_shorter_length_is_counted_at_that_length() -> None:
    base = dict(vocab_size=32, dim=32, depth=2, heads=4, seq_len=64, attention="local:2,routing:2", rel_clip=8)
    routing = dict(num_clusters=8, window=8, probes=2, warmup=10)
    full, short = (TransformerLM(TransformerConfig(**base, options={"local": {"window": 8}, "routing": {
        **routing, "warmup_len": n}})) for n in (None, 16))
    assert [short.config.train_len(s) for s in (0, 9, 10, 100)] == [16, 16, 64, 64]
    assert [full.config.train_len(s) for s in (0, 9, 10)] == [64, 64, 64]
    # the same tokens per step, each scoring the keys of a 16-token context while the warm-up lasts
    warm = 10 * 100 * short.flops_per_token(16, step=0)
    assert short.training_flops(30, 100) == pytest.approx(warm + 20 * 100 * short.flops_per_token())
    assert short.training_flops(30, 100) < full.training_flops(30, 100)
    assert short.flops_per_token(16, step=0) < full.flops_per_token(64, step=0)


def test_the_trainers_length_warm_up_is_counted_at_its_length() -> None:
    """train.short_steps / short_len: the first steps at the short length, the shorter of it and a routing
    warm-up's length while both run; rows never longer than seq_len."""
    base = dict(vocab_size=32, dim=32, depth=2, heads=4, seq_len=64, attention="local:2,routing:2", rel_clip=8)
    routing = dict(num_clusters=8, window=8, warmup=10, warmup_len=32)
    model = TransformerLM(TransformerConfig(**base, options={"local": {"window": 8}, "routing": routing}))
    per = model.flops_per_token
    expected = 10 * 100 * per(16, step=0) + 10 * 100 * per(16, step=10) + 10 * 100 * per(64, step=20)
    assert model.training_flops(30, 100, short_steps=20, short_len=16) == pytest.approx(expected)
    expected = 5 * 100 * per(16, step=0) + 5 * 100 * per(32, step=5) + 20 * 100 * per(64, step=10)
    assert model.training_flops(30, 100, short_steps=5, short_len=16) == pytest.approx(expected)
    expected = 10 * 100 * per(16, step=0) + 20 * 100 * per(16, step=10)  # a warm-up longer than the run
    assert model.training_flops(30, 100, short_steps=40, short_len=16) == pytest.approx(expected)
    assert model.training_flops(30, 100) == model.training_flops(30, 100, short_steps=0, short_len=0)


@pytest.mark.parametrize("fields, fragment", [  # options.routing settings
    ({"warmup_len": 24}, r"must divide seq_len \(64\)"),  # checked even with no warm-up to use it
    ({"warmup": 5, "warmup_len": 24}, r"must divide seq_len \(64\)"),
    ({"warmup": 5, "warmup_len": 0}, "options.routing: warmup_len must be a positive integer"),
])
def test_bad_warm_up_lengths(fields: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        TransformerConfig(vocab_size=32, dim=32, depth=1, heads=2, seq_len=64, attention="local:1,routing:1",
                          rel_clip=8, options={"local": {"window": 8}, "routing": {"num_clusters": 4, **fields}})


def test_a_warm_up_length_without_a_warm_up_changes_nothing() -> None:
    """A configuration that ships a warm-up stays usable with warmup = 0 (``--set options.routing.warmup=0``)."""
    fields = dict(vocab_size=32, dim=32, depth=1, heads=2, seq_len=64, attention="local:1,routing:1", rel_clip=8)
    plain, unused = (TransformerConfig(**fields, options={"local": {"window": 8}, "routing": {
        "num_clusters": 4, **routing}}) for routing in ({}, {"warmup_len": 16}))
    assert unused.train_len(0) == 64 and unused.warmups() == plain.warmups()
    assert unused.describe_heads() == plain.describe_heads()
    assert TransformerLM(unused).training_flops(10, 640) == TransformerLM(plain).training_flops(10, 640)


def test_cut_sequences_keeps_every_next_token_prediction() -> None:
    from routeformer.data.loader import cut_sequences

    tokens = torch.arange(2 * 13).view(2, 13)  # (B, L + 1) with L = 12
    pieces = cut_sequences(tokens, 4)
    assert pieces.shape == (6, 5)
    inputs, targets = pieces[:, :-1].reshape(2, 12), pieces[:, 1:].reshape(2, 12)
    assert torch.equal(inputs, tokens[:, :-1]) and torch.equal(targets, tokens[:, 1:])
    with pytest.raises(ValueError, match="cannot cut sequences of 12 tokens into pieces of 5"):
        cut_sequences(tokens, 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_probes_in_half_precision_match_float64_over_the_same_routing(dtype: torch.dtype) -> None:
    """N = 1024 takes the ranges; the first key of each cluster leaves its queries with no other key (shared QK:
    they see their own), so the empty slots of a half-precision tile must count as empty."""
    torch.manual_seed(0)
    layer = routing_layer(4, 8, num_clusters=32, window=32, probes=2)
    q, v = (torch.randn(1, 4, 1024, 8).to(dtype) for _ in range(2))
    with torch.no_grad():  # routing runs in float32 from the same values: the same clusters and probes
        exact = layer(q.double(), q.double(), v.double())
        low = layer(q, q, v)
    assert low.dtype == dtype
    error = (low.double() - exact).norm(dim=-1) / exact.norm(dim=-1)  # (B, H, N): per query
    assert error.max().item() < 8 * torch.finfo(dtype).eps  # measured: float16 2.4 eps (an lse bug gave 1100 eps)


def test_crowded_stretches_do_not_grow_the_tiles(monkeypatch) -> None:
    """Most queries probe a cluster whose keys all came early (so their ranges end in one stretch of keys) and a
    cluster with no key at all: the tiles' R rows per stretch stay within two rows per entry (uncapped, one step
    of a model at N = 2048 took 24 GB), the rest goes through the gathered pass, and the output is the reference's."""
    from routeformer.attention.routing.probes import probed_window_attention, probed_window_mask
    from routeformer.executors import Inputs, get_executor, ranges

    chosen = []
    tile_rows = ranges._tile_rows
    monkeypatch.setattr(ranges, "_tile_rows", lambda counts, entries: chosen.append(
        (tile_rows(counts, entries), counts.shape[-1], entries)) or chosen[-1][0])
    torch.manual_seed(0)
    B, H, N, D = 1, 2, 512, 8
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64) for _ in range(3))
    clusters = torch.zeros(B, H, N, dtype=torch.long)
    clusters[..., :40] = 1  # cluster 1: the first 40 keys only
    probes = torch.stack([torch.ones_like(clusters), torch.full_like(clusters, 2)], -1)  # 1, and 2 (empty)
    probes[..., 40:, 0] = torch.where(torch.arange(N - 40) % 4 == 0, 0, 1)  # a few later queries probe cluster 0
    out = probed_window_attention(Inputs(q, k, v, D ** -0.5), clusters, probes,
                                  RoutingOptions(window=12, shared_qk=False), sort=sort_by_cluster(clusters),
                                  executor=get_executor("tiles"))
    want = reference_attention(Inputs.of(q, k, v), probed_window_mask(clusters, probes, 12, exclude_self=False))
    torch.testing.assert_close(out, want)
    R, groups, entries = chosen[0]
    assert groups * R <= 2 * entries + 8 * groups  # crowded: without the cap R would be ~ the crowded group's count


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("own_first", [True, False])
def test_shared_qk_queries_with_no_other_key_see_their_own_through_the_ranges(own_first: bool, padding: bool) -> None:
    """N = 512 takes the ranges. Queries whose probed windows hold no key but their own see it, if they probe their
    own cluster (not own_first: a quarter probe two other clusters, as separate routing may, and see nothing): from
    the ranges before attending, or (padding: ranges of padded keys only) after. Forward and gradients against the
    dense mask in float64."""
    from routeformer.attention.routing.probes import probed_window_attention, probed_window_mask
    from routeformer.executors import Inputs, get_executor

    g = torch.Generator().manual_seed(5)
    B, H, N, D, k = 1, 2, 512, 8, 24
    q, v = (torch.randn(B, H, N, D, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    clusters = torch.randint(0, k, (B, H, N), generator=g)
    other = (clusters + torch.randint(1, k, (B, H, N), generator=g)) % k  # a second, different cluster
    probes = torch.stack([clusters, other], -1)
    if not own_first:  # a quarter of the queries probe two clusters, neither their own
        third = (clusters + torch.randint(1, k, (B, H, N), generator=g)) % k
        third = torch.where(third == other, (other + 1) % k, third)
        third = torch.where(third == clusters, (third + 1) % k, third)
        swap = torch.rand(B, H, N, generator=g) < 0.25
        probes[..., 0] = torch.where(swap, third, clusters)
    valid = (torch.rand(B, 1, N, generator=g) > 0.2) if padding else None
    mask = probed_window_mask(clusters, probes, 6, exclude_self=True, key_valid=valid)
    alone = mask.sum(-1) == 1
    assert alone.sum() > 20, "the test needs queries that see only their own key"
    if not own_first:
        assert (alone & (probes != clusters[..., None]).all(-1)).any(), "... and some that do not probe their own"
    out = probed_window_attention(Inputs(q, q, v, D ** -0.5, valid), clusters, probes,
                                  RoutingOptions(window=6, shared_qk=True), sort=sort_by_cluster(clusters),
                                  executor=get_executor("tiles"))
    want = reference_attention(Inputs.of(q, q, v), mask)
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, v), grad)
    expected = torch.autograd.grad(want, (q, v), grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


# --- the hand-over: dense with a growing penalty on the keys routing would not score, then routed -------------

def _handover_bias(layer: RoutingAttention, q, k, step: int) -> torch.Tensor:
    """Written from the definition: -16 · (s + 1) / handover on the pairs outside the routed mask (the union of
    the probes' windows before the own-key rule), 0 on those inside."""
    routed = probe_masks(layer.routing.route_keys(q, k), layer.routing.probe(q, k), layer.window).any(2)
    return (~routed).double() * -16.0 * (step - layer.warmup + 1) / layer.handover


@pytest.mark.parametrize("shared", [True, False])
def test_the_hand_over_penalises_the_unrouted_keys_more_each_step_then_routes(shared: bool) -> None:
    layer = _layer(shared_qk=shared, probes=2, warmup=1, handover=3)
    q, k, v = rand_qkv(2, 2, 30, 8)
    k = q if shared else k
    rel = rand_rel(8, 5)
    q.requires_grad_(True)
    layer.update()  # the warm-up's one step
    outs = []
    for step in range(1, 4):
        assert layer.handing_over and not layer.warming_up and int(layer.routing.steps) == step
        n = q.shape[2]
        allow = torch.ones(n, n, dtype=torch.bool).tril()
        if shared:
            allow = allow & ~(torch.eye(n, dtype=torch.bool) & (torch.arange(n) > 0)[:, None])
        want = reference_attention(Inputs.of(q, k, v), allow, rel=rel, bias=_handover_bias(layer, q, k, step))
        out = layer(q, k, v, rel_pos=rel)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(torch.autograd.grad(out.square().sum(), q)[0],
                                   torch.autograd.grad(want.square().sum(), q)[0], rtol=1e-9, atol=1e-10)
        outs.append(layer.handover_penalty())
        layer.update()
    assert not layer.handing_over and not layer.dense
    routed = layer(q, k, v, rel_pos=rel).detach()
    torch.testing.assert_close(routed, reference_attention(Inputs.of(q, k, v), layer.routing_mask(q, k), rel=rel))
    assert outs == pytest.approx([16 / 3, 32 / 3, 16])  # growing linearly to 16 nats at the last step


def test_routed_pairs_is_the_union_of_the_probes_windows() -> None:
    from routeformer.attention.routing.probes import routed_pairs

    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        n, k, w = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 40), (1, 6), (1, 6)))
        p = int(torch.randint(1, k + 1, (1,), generator=g))
        clusters = torch.randint(k, (2, 3, n), generator=g)
        probes = torch.stack([torch.randperm(k, generator=g)[:p] for _ in range(2 * 3 * n)]).view(2, 3, n, p)
        assert torch.equal(routed_pairs(clusters, probes, w, k), probe_masks(clusters, probes, w).any(2))


def test_a_model_decodes_exactly_during_and_after_the_hand_over() -> None:
    """Through the warm-up (1 step), the hand-over (2 steps) and after it, decoding reproduces the forward."""
    config = TransformerConfig(vocab_size=32, dim=32, depth=2, heads=4, seq_len=40, attention="local:2,routing:2",
                               options={"local": {"window": 6}, "routing": {
                                   "num_clusters": 4, "window": 5, "probes": 2, "balance": 0.05, "warmup": 1,
                                   "handover": 2}})
    kinds, outs = _decode_through_training_steps(config, 4)
    assert kinds == [KeyStore, KeyStore, KeyStore, RoutingCache]
    assert not torch.allclose(outs[1], outs[2])  # the penalty grew


def test_a_hand_over_is_counted_dense_at_the_model_length() -> None:
    base = dict(vocab_size=32, dim=32, depth=2, heads=4, seq_len=64, attention="local:2,routing:2")
    routing = dict(num_clusters=8, window=8, probes=2, warmup=10, warmup_len=16)
    plain, handed = (TransformerLM(TransformerConfig(**base, options={"local": {"window": 8}, "routing": {
        **routing, "handover": h}})) for h in (0, 5))
    assert [handed.config.train_len(s) for s in (0, 9, 10, 14, 15)] == [16, 16, 64, 64, 64]
    assert handed.config.cost_changes() == [10, 15]
    extra = 5 * 100 * (handed.flops_per_token(64, step=10) - handed.flops_per_token())
    assert extra > 0
    assert handed.training_flops(30, 100) == pytest.approx(plain.training_flops(30, 100) + extra)
    assert "hand-over=5" in handed.config.describe_heads()


def test_a_layer_in_its_hand_over_has_no_routed_cache_and_bad_hand_overs_are_refused() -> None:
    with pytest.raises(ValueError, match="attends densely for 3 more optimiser steps"):
        routing_layer(2, 8, 4, 5, warmup=1, handover=2).new_cache(1, None)
    with pytest.raises(ValueError, match="handover must be a non-negative integer"):
        routing_layer(2, 8, 4, 5, handover=-1)
    with pytest.raises(ValueError, match="options.routing: handover must be a non-negative integer"):
        TransformerConfig(vocab_size=32, dim=32, depth=1, heads=2, seq_len=64, attention="local:1,routing:1",
                          options={"local": {"window": 8}, "routing": {"handover": 1.5}})


def test_the_heads_reference_and_weights_carry_the_hand_over_penalty() -> None:
    """The head group's dense definition (``reference``, ``reference_weights``, what analysis reads) during the
    hand-over is the forward, penalty included; without the penalty it would not be."""
    from routeformer.attention.routing.kind import KIND, RoutingOptions

    options = RoutingOptions(num_clusters=4, window=5, probes=2, balance=0.01, warmup=1, handover=2)
    group = KIND.build(options, 2, 8, 0).double()
    q, _, v = rand_qkv(2, 2, 30, 8)
    rel = rand_rel(8, 5)
    group.after_optimizer_step(0, None)  # the warm-up's one step: now in the hand-over
    assert group.handing_over
    out = group(q, q, v, rel)
    torch.testing.assert_close(group.reference(q, q, v, rel), out, rtol=1e-10, atol=1e-10)
    weights = group.reference_weights(q, q, rel).detach()
    plain = reference_attention(Inputs.of(q, q, v), group.reference_mask(q, q), rel=rel)
    assert not torch.allclose(plain, out)
    routed = probe_masks(group.routing.route_keys(q, q), group.routing.probe(q, q), 5).any(2)
    dense = reference_weights(q, q, group.reference_mask(q, q), rel_pos=rel).detach()  # no penalty
    assert float((weights * ~routed).sum()) < float((dense * ~routed).sum())


@pytest.mark.parametrize("exclude_self", [False, True])
def test_probe_ranges_take_the_clusters_first_keys_from_the_sorts_sizes_as_from_a_search(exclude_self: bool) -> None:
    """The fused routers hand over the sort with its cluster sizes; the ranges' first keys taken from them are the
    ones a search of the sorted clusters finds (empty clusters, and the last cluster, included)."""
    g = torch.Generator().manual_seed(3)
    k, N = 9, 200
    clusters = torch.randint(0, k - 2, (2, 3, N), generator=g)  # clusters 7 and 8 empty
    clusters[0, 0, -5:] = k - 1
    probes = torch.stack([clusters, torch.randint(0, k, (2, 3, N), generator=g)], -1)
    probes[..., 1] = torch.where(probes[..., 1] == probes[..., 0], (probes[..., 0] + 1) % k, probes[..., 1])
    sized = sort_by_cluster(clusters, k)
    assert sized.counts is not None
    plain = sized._replace(rank=None, counts=None)
    got = probes_module.probe_ranges(clusters, probes, 16, sized, exclude_self)
    want = probes_module.probe_ranges(clusters, probes, 16, plain, exclude_self)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    first = (sized.counts.cumsum(-1) - sized.counts).gather(-1, probes.flatten(-2))
    assert (got[0] >= first).all() and (got[0] <= got[1]).all()


@pytest.mark.skipif(not fused_available(), reason="the fused kernels are not built here")
@pytest.mark.parametrize("p, window, exclude_self, own_when_alone",
                         [(1, 16, False, False), (2, 1, True, True), (2, 5, True, False), (3, 7, True, True),
                          (2, 300, False, False)])
def test_the_fused_probe_ranges_are_the_definitions(p: int, window: int, exclude_self: bool,
                                                     own_when_alone: bool) -> None:
    """The fused executor's ``probes_run``, one counting pass, against ``probe_ranges`` (a search of the sorted
    keys) and ``_own_key_when_alone``: the same integers, with empty clusters, a window of one (where exclude_self
    leaves queries alone), a window past every cluster, and the last cluster probed."""
    g = torch.Generator().manual_seed(4)
    k, N = 11, 230
    clusters = torch.randint(0, k - 3, (2, 3, N), generator=g)  # 8 and 9 empty, 10 the last
    clusters[1, 2, -7:] = k - 1
    probes = torch.stack([clusters] + [torch.randint(0, k, (2, 3, N), generator=g) for _ in range(p - 1)], -1)
    for t in range(1, p):  # distinct per query: moved on past any earlier probe
        for _ in range(p):
            clash = (probes[..., t:t + 1] == probes[..., :t]).any(-1)
            probes[..., t] = torch.where(clash, (probes[..., t] + 1) % k, probes[..., t])
    assert all(len(set(row)) == p for row in probes.reshape(-1, p).tolist())
    lo, hi = probes_module.probe_ranges(clusters, probes, window, sort_by_cluster(clusters, k), exclude_self)
    if own_when_alone:
        before = hi
        hi = probes_module._own_key_when_alone(lo, hi, clusters, probes)
        assert (hi > lo).view(2, 3, N, p).any(-1).all()  # every query sees a key: its own where alone
        assert window > 1 or (hi != before).any()  # a window of one leaves queries alone: their own key given back
    got = get_executor("fused").probes_run(clusters, probes, window, exclude_self, own_when_alone)
    assert got is not None
    assert torch.equal(got[0], lo) and torch.equal(got[1], hi)


@pytest.mark.skipif(not fused_available(), reason="the fused kernels are not built here")
def test_the_fused_probe_ranges_name_what_is_wrong() -> None:
    ranges = torch.ops.routeformer_fused.probe_ranges
    clusters = torch.zeros(1, 2, 8, dtype=torch.long)
    probes = torch.zeros(1, 2, 8, 2, dtype=torch.long)
    outside = r"probe_ranges: key_clusters must be in \[0, 2\^24\), got "
    with pytest.raises(RuntimeError, match=outside + "-1 at flat index 3"):
        ranges(clusters.index_fill(-1, torch.tensor([3]), -1), probes, 4, False, False)
    with pytest.raises(RuntimeError, match=outside + "16777216"):
        ranges(clusters.index_fill(-1, torch.tensor([5]), 1 << 24), probes, 4, False, False)
    with pytest.raises(RuntimeError, match=r"probe_ranges: probes must be >= 0, got -2 at flat index 1"):
        ranges(clusters, probes.flatten().index_fill(0, torch.tensor([1]), -2).view_as(probes), 4, False, False)
    with pytest.raises(RuntimeError, match=r"probe_ranges: probes must be \(B, H, N, p\)"):
        ranges(clusters, probes[:, :1], 4, False, False)
    with pytest.raises(RuntimeError, match=r"probe_ranges: window must be >= 1, got 0"):
        ranges(clusters, probes, 0, False, False)
    with pytest.raises(RuntimeError, match=r"probe_ranges: own_when_alone .* needs exclude_self"):
        ranges(clusters, probes, 4, False, True)
