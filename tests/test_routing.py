"""RoutingAttention: the forward is reference_attention over routing_mask, the mask means what it says, no leaks."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import compare_with_reference, leaks, rand_padding, rand_qkv, rand_rel, routing_layer
from routeformer.attention import Inputs, RoutingAttention, full_attention, reference_attention
from routeformer.attention.routing import probes as probes_module


def make_layer(H: int, D: int, k: int, w: int, dtype=torch.float64, **kw) -> RoutingAttention:
    return routing_layer(H, D, k, w, **kw).to(dtype)


@st.composite
def routing_problems(draw) -> dict:
    causal = draw(st.booleans())
    k = draw(st.integers(1, 9))
    return {
        "B": draw(st.integers(1, 2)), "H": draw(st.integers(1, 3)), "N": draw(st.integers(1, 60)),
        "D": draw(st.integers(2, 10)), "k": k, "w": draw(st.integers(1, 12)),
        "causal": causal, "balanced": False if causal else draw(st.booleans()),
        "shared": (shared := draw(st.booleans())), "separate": causal and not shared and draw(st.booleans()),
        "probes": draw(st.integers(1, min(k, 3))) if causal else 1, "bias": causal and draw(st.booleans()),
        "rel": draw(st.one_of(st.none(), st.integers(1, 20))),
        "padding": draw(st.booleans()), "seed": draw(st.integers(0, 2**16)),
        "dense": draw(st.booleans()),  # several probes: one dense tile, or the ranges of longer sequences
    }


def random_bias(layer: RoutingAttention, seed: int) -> None:
    """A bias as training leaves it: large enough to move assignments."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        layer.routing.bias.copy_(0.5 * torch.randn(layer.routing.bias.shape, generator=gen))


@given(p=routing_problems())
def test_forward_matches_reference_over_routing_mask(p: dict) -> None:
    _check_against_reference(p, "tiles")


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 7-17 s a worker): CI's slow line runs it
@settings(max_examples=10)
@given(p=routing_problems())
def test_flex_forward_matches_reference_over_routing_mask(p: dict) -> None:
    _check_against_reference(p, "flex")


@given(p=routing_problems())
def test_fused_forward_matches_reference_over_routing_mask(p: dict) -> None:
    _check_against_reference(p, "fused")


def _check_against_reference(p: dict, backend: str) -> None:
    with mock.patch.object(probes_module, "DENSE_UP_TO", 10**9 if p["dense"] else 0):
        _check_path_against_reference(p, backend)


def _check_path_against_reference(p: dict, backend: str) -> None:
    torch.manual_seed(p["seed"])
    layer = make_layer(p["H"], p["D"], p["k"], p["w"], causal=p["causal"], balanced=p["balanced"],
                       shared_qk=p["shared"], separate=p["separate"], probes=p["probes"],
                       balance=0.01 if p["bias"] else 0.0, seed=p["seed"], backend=backend)
    if p["bias"]:
        random_bias(layer, p["seed"])
    q, k, v = rand_qkv(p["B"], p["H"], p["N"], p["D"], seed=p["seed"])
    if p["shared"]:
        k = q
    rel = None if p["rel"] is None else rand_rel(p["D"], p["rel"], seed=p["seed"])
    padding = rand_padding(p["B"], p["N"], seed=p["seed"]) if p["padding"] else None
    mask = layer.routing_mask(q, k, key_padding_mask=padding)
    compare_with_reference(lambda q_, k_, v_, **kw: layer(q_, q_ if p["shared"] else k_, v_, **kw),
                           mask, q, k, v, key_padding_mask=padding, rel_pos=rel)


def _recent_same_cluster(clusters: torch.Tensor, i: int, window: int) -> set[int]:
    same = [j for j in range(i + 1) if clusters[j] == clusters[i]]
    return set(same[-window:])


@pytest.mark.parametrize("shared", [True, False])
def test_causal_mask_is_the_most_recent_window_of_the_own_cluster(shared: bool) -> None:
    H, N, D, k, w = 3, 80, 8, 5, 4
    layer = make_layer(H, D, k, w, causal=True, shared_qk=shared)
    q, kk, _ = rand_qkv(2, H, N, D, grad=False)
    kk = q if shared else kk
    mask, clusters = layer.routing_mask(q, kk), layer.routing.route(q, kk)
    assert torch.equal(mask, mask.tril()), "a causal mask must be lower-triangular"
    same = clusters[..., :, None] == clusters[..., None, :]
    assert not (mask & ~same).any(), "a query sees only its own cluster"
    assert int(mask.sum(-1).max()) <= w
    full = w - 1 if shared else w  # a full window, less the query's own key under shared QK
    assert len(torch.unique(clusters)) > 1 and int((mask.sum(-1) == full).sum()) > 0  # the window does bind
    for b in range(2):
        for h in range(H):
            for i in range(N):
                want = _recent_same_cluster(clusters[b, h], i, w)
                if shared and len(want) > 1:
                    want.discard(i)  # shared QK: not its own key unless nothing else is left
                got = set(mask[b, h, i].nonzero().flatten().tolist())
                assert got == want, (b, h, i)


def _probed_window(keys: list[int], probes: list[int], i: int, window: int, shared: bool) -> set[int]:
    """The last `window` keys j <= i of each probed cluster; shared QK: not its own unless nothing else."""
    seen: set[int] = set()
    for c in probes:
        seen |= set([j for j in range(i + 1) if keys[j] == c][-window:])
    if shared and len(seen) > 1:
        seen.discard(i)
    return seen


@pytest.mark.parametrize("shared, separate, probes", [(True, False, 2), (True, False, 3), (False, False, 2),
                                                      (False, True, 1), (False, True, 2)])
def test_probed_mask_is_the_last_window_keys_of_each_probed_cluster(shared: bool, separate: bool,
                                                                    probes: int) -> None:
    H, N, D, k, w = 3, 80, 8, 4, 5
    layer = make_layer(H, D, k, w, causal=True, shared_qk=shared, separate=separate, probes=probes, balance=0.01)
    random_bias(layer, 0)
    q, kk, _ = rand_qkv(2, H, N, D, grad=False)
    kk = q if shared else kk
    mask, probed, keys = layer.routing_mask(q, kk), layer.routing.probe(q, kk), layer.routing.route_keys(q, kk)
    if separate:
        assert not torch.equal(probed[..., 0], keys), "queries and keys are routed apart"
    assert int(mask.sum(-1).max()) <= probes * w and int((mask.sum(-1) >= w).sum()) > 0  # the windows bind
    for b in range(2):
        for h in range(H):
            for i in range(N):
                want = _probed_window(keys[b, h].tolist(), probed[b, h, i].tolist(), i, w, shared)
                assert set(mask[b, h, i].nonzero().flatten().tolist()) == want, (b, h, i)


@pytest.mark.parametrize("shared, separate, probes", [(True, False, 1), (False, False, 1), (False, True, 1),
                                                      (True, False, 3), (False, True, 2)])
@pytest.mark.parametrize("extras", ["plain", "relative", "padding", "gate"])
@pytest.mark.parametrize("backend", ["tiles", "flex", "fused"])
def test_no_leak_from_the_future(shared: bool, separate: bool, probes: int, extras: str, backend: str,
                                 monkeypatch) -> None:
    """On the ranges of longer sequences (the dense tile of short ones is its mask, whose causality
    test_probed_mask_is_the_last_window_keys_of_each_probed_cluster checks, and two cases below)."""
    monkeypatch.setattr(probes_module, "DENSE_UP_TO", 0)
    _no_leak(shared, separate, probes, extras, backend)


@pytest.mark.parametrize("shared, separate", [(True, False), (False, True)])
def test_no_leak_from_the_future_through_the_dense_tile(shared: bool, separate: bool, monkeypatch) -> None:
    monkeypatch.setattr(probes_module, "DENSE_UP_TO", 10**9)
    _no_leak(shared, separate, 3, "relative", "tiles")


def _no_leak(shared: bool, separate: bool, probes: int, extras: str, backend: str) -> None:
    H, N, D = 4, 64, 8
    layer = make_layer(H, D, 6, 5, causal=True, shared_qk=shared, separate=separate, probes=probes,
                       balance=0.01, gate=extras == "gate", backend=backend)
    random_bias(layer, 1)
    q, k, v = rand_qkv(2, H, N, D, grad=False)
    kw: dict = {}
    if extras == "relative":
        kw["rel_pos"] = rand_rel(D, 10)
    if extras == "padding":
        kw["key_padding_mask"] = rand_padding(2, N)
    for t in [0, 7, 30, 62]:
        assert not leaks(lambda q_, k_, v_: layer(q_, q_ if shared else k_, v_, **kw), q, k, v, t, atol=1e-12)


def test_non_causal_routing_does_see_the_future() -> None:
    """Control for the leak test: the balanced (encoder) mode uses later tokens."""
    layer = make_layer(2, 8, 3, 8, causal=False)
    q, k, v = rand_qkv(1, 2, 40, 8, grad=False)
    assert leaks(lambda q_, k_, v_: layer(q_, q_, v_), q, q, v, 10, atol=1e-12)


@pytest.mark.parametrize("causal, balanced", [(True, False), (False, False), (False, True)])
def test_one_cluster_and_a_window_covering_everything_is_full_attention(causal: bool, balanced: bool) -> None:
    layer = make_layer(2, 8, 1, 64, causal=causal, balanced=balanced, shared_qk=False)
    q, k, v = rand_qkv(2, 2, 50, 8, grad=False)
    torch.testing.assert_close(layer(q, k, v), full_attention(Inputs.of(q, k, v), causal=causal))


def test_separate_routing_with_one_cluster_and_a_window_of_every_key_is_full_attention() -> None:
    layer = make_layer(2, 8, 1, 50, causal=True, shared_qk=False, separate=True)
    q, k, v = rand_qkv(2, 2, 50, 8, grad=False)
    torch.testing.assert_close(layer(q, k, v), full_attention(Inputs.of(q, k, v), causal=True))


def test_balanced_tokens_in_several_clusters_and_in_none_are_both_exercised() -> None:
    """The property test above covers these cases only if they occur: make sure they do."""
    from routeformer.attention.routing.balanced import _membership, balanced_members

    layer = make_layer(2, 8, 4, 6, causal=False)
    q, _, _ = rand_qkv(2, 2, 37, 8, grad=False)
    members = balanced_members(layer.routing.kmeans.scores(layer.routing.routing_vectors(q, q)), 6, None)
    per_token = _membership(members, 37).sum(2)
    assert (per_token == 0).any() and (per_token > 1).any()


@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_balanced_clusters_past_one_word_of_membership_bits(backend: str) -> None:
    """130 clusters: the members' bit sets take three 63-bit words, and a pair is counted in its first common
    cluster across words; against the reference mask (forward and gradients), tokens in many clusters."""
    layer = make_layer(2, 8, 130, 5, causal=False, balanced=True, shared_qk=False, seed=3, backend=backend)
    q, k, v = rand_qkv(1, 2, 80, 8, seed=3)
    mask = layer.routing_mask(q, k)
    compare_with_reference(layer, mask, q, k, v)


@pytest.mark.parametrize("shared", [True, False])
def test_balanced_members_are_the_window_nearest_tokens_of_each_centroid(shared: bool) -> None:
    """Built independently: each cluster's members are the w tokens of highest cosine to its centroid; a padded
    token is chosen only when fewer than w real ones exist (which padded ones is unspecified). The layer's mask is
    built from exactly these members and the argmax clusters."""
    from routeformer.attention.routing.balanced import balanced_mask, balanced_members

    B, H, N, D, kc, w = 2, 3, 23, 8, 4, 7
    layer = make_layer(H, D, kc, w, causal=False, balanced=True, shared_qk=shared)
    q, k, _ = rand_qkv(B, H, N, D, grad=False)
    k = q if shared else k
    padding = torch.ones(B, N, dtype=torch.bool)
    padding[0, ::3] = False
    padding[1, 5:] = False  # 5 real tokens < w: two padded members per cluster
    r = layer.routing.routing_vectors(q, k)
    mu = layer.routing.kmeans.centroids
    got = balanced_members(layer.routing.kmeans.scores(r), w, padding)
    assert got.shape == (B, H, kc, w)
    clusters = torch.zeros(B, H, N, dtype=torch.long)
    for b in range(B):
        real = [j for j in range(N) if padding[b, j]]
        for h in range(H):
            cos = [[float(r[b, h, j] @ mu[h, c]) for j in range(N)] for c in range(kc)]
            for j in range(N):
                clusters[b, h, j] = max(range(kc), key=lambda c, j=j: cos[c][j])
            for c in range(kc):
                nearest = sorted(real, key=lambda j, c=c: -cos[c][j])[:w]
                members = got[b, h, c].tolist()
                assert members == sorted(set(members)), "members are distinct, in position order"
                # the real members are the nearest real tokens: all w of them, or every real token and padding
                assert [j for j in members if padding[b, j]] == sorted(nearest), (b, h, c)
    assert torch.equal(layer.routing.route(q, k), clusters)
    mask = layer.routing_mask(q, k, key_padding_mask=padding)
    assert torch.equal(mask, balanced_mask(got, clusters, shared, padding[:, None, :]))


def test_commitment_loss_and_its_gradient() -> None:
    layer = make_layer(2, 8, 3, 4, dtype=torch.float32, commitment=0.5)
    q, _, v = rand_qkv(1, 2, 20, 8, dtype=torch.float32)
    layer(q, q, v)
    r = layer.routing.routing_vectors(q, q)
    mu = layer.routing.kmeans.centroids[torch.arange(2)[None, :, None], layer.routing.route(q, q)]
    want = 0.5 * (r - mu).square().sum(-1).mean()
    torch.testing.assert_close(layer.commitment_loss, want)
    layer.commitment_loss.backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    layer.eval()(q, q, v)  # evaluation and generation need no training loss
    assert layer.commitment_loss is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_routes_in_float32_without_nan(dtype) -> None:
    layer = make_layer(2, 16, 4, 8, dtype=torch.float32)
    q, k, v = (x.to(dtype) for x in rand_qkv(2, 2, 70, 16, dtype=torch.float32, grad=False))
    assert layer.routing.routing_vectors(q, q).dtype == torch.float32
    assert torch.equal(layer.routing.route(q, q), layer.routing.route(q.float(), q.float()))
    out = layer(q, q, v)
    assert out.dtype == dtype and torch.isfinite(out).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(q.float(), q.float(), v.float())
    assert torch.isfinite(out).all()


def test_state_dict_holds_centroids_and_projection() -> None:
    a = make_layer(2, 8, 3, 4)
    a.routing.kmeans.centroids.copy_(torch.nn.functional.normalize(torch.randn(2, 3, 8, dtype=torch.float64),
                                                                   dim=-1))
    state = a.state_dict()  # the router's: a model's routing heads save the same keys under their group
    assert {"routing.kmeans.centroids", "routing.kmeans.ema_sums", "routing.kmeans.ema_counts",
            "routing.kmeans.initialized", "routing.projection"} <= set(state)
    b = make_layer(2, 8, 3, 4, seed=5)
    b.load_state_dict(state)
    q, _, v = rand_qkv(1, 2, 30, 8, grad=False)
    torch.testing.assert_close(a(q, q, v), b(q, q, v), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"num_clusters": 0}, "num_clusters must be a positive integer, got 0"),
    ({"num_clusters": 2.5}, "num_clusters"),
    ({"window": -1}, "window must be a positive integer, got -1"),
    ({"window": True}, "window"),
    ({"causal": True, "balanced": True}, "balanced=True needs causal=False"),
    ({"decay": 1.0}, "decay"),
    ({"separate": True}, "separate = true .* needs shared_qk = false"),
    ({"separate": True, "shared_qk": False, "causal": False}, "separate apply to causal routing only"),
    ({"probes": 2, "balance": 0.1, "causal": False}, "probes, balance apply to causal routing only"),
    ({"probes": 4}, r"probes \(4\) must be at most num_clusters \(3\)"),
    ({"probes": 0}, "probes must be a positive integer"),
    ({"balance": -0.1}, "balance must be a non-negative number"),
    ({"warmup": -1}, "warmup must be a non-negative integer"),
    ({"warmup": 2.5}, "warmup must be a non-negative integer"),
])
def test_bad_configuration(kwargs: dict, fragment: str) -> None:
    args = {"heads": 2, "head_dim": 8, "num_clusters": 3, "window": 4, **kwargs}
    with pytest.raises(ValueError, match=fragment):
        routing_layer(**args)


def test_bad_inputs() -> None:
    layer = make_layer(2, 8, 3, 4, dtype=torch.float32)
    q, k, v = rand_qkv(1, 2, 10, 8, dtype=torch.float32, grad=False)
    with pytest.raises(ValueError, match="same shape"):
        layer(q, k[:, :, :9], v)
    with pytest.raises(ValueError, match="same dtype"):
        layer(q, k, v.double())
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, N, D\)"):
        layer(q[0], k[0], v[0])


@pytest.mark.parametrize("causal, balanced", [(True, False), (False, False), (False, True)])
def test_non_contiguous_inputs(causal: bool, balanced: bool) -> None:
    layer = make_layer(4, 8, 3, 5, causal=causal, balanced=balanced, shared_qk=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 41, 4, 8, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(3))
    rel = rand_rel(8, 6)
    got = layer(q, k, v, rel_pos=rel)
    torch.testing.assert_close(got, layer(q.contiguous(), k.contiguous(), v.contiguous(), rel_pos=rel), rtol=0,
                               atol=1e-12)
    torch.testing.assert_close(got, reference_attention(Inputs.of(q, k, v), layer.routing_mask(q, k), rel=rel))
