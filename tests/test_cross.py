"""Cross-attention: queries of one sequence over a memory's keys and values (another length), on every executor,
against one dense definition (``reference_cross_attention``), forward and gradients; padding, leaks, refusals."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close_with_grads, rand_rel
from routeformer.attention import (
    FixedOptions,
    Inputs,
    KernelOptions,
    LinearOptions,
    LocalOptions,
    LongformerOptions,
    LSHOptions,
    MobaOptions,
    PerformerOptions,
    StridedOptions,
    cross_routes,
    fixed_attention,
    full_attention,
    linear_attention,
    local_attention,
    longformer_attention,
    lsh_attention,
    moba_cross_attention,
    orthogonal_features,
    performer_attention,
    routing_cross_attention,
    strided_attention,
)
from routeformer.attention.moba import moba_cross_mask
from routeformer.attention.performer import performer_features
from routeformer.attention.reference import reference_cross_attention
from routeformer.attention.routing.cross import CrossRoutes, default_window, routing_cross_mask

EXECUTORS = ["fused", "tiles", "flex"]
B, H, NQ, NK, D = 2, 3, 37, 53, 8


def memory_inputs(seed: int = 0, nq: int = NQ, nk: int = NK, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, nq, D, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(B, H, nk, D, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    return q, k, v


def memory_padding(nk: int = NK) -> torch.Tensor:
    mask = torch.ones(B, nk, dtype=torch.bool)
    mask[1, nk - 13:] = False  # the second row's memory is shorter
    mask[1, 3] = False  # and has a hole
    return mask


def centroids(clusters: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(H, clusters, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def close(out, ref, inputs):
    assert_close_with_grads(out, ref, inputs, rtol=1e-9, atol=1e-10, grad_rtol=1e-8, grad_atol=1e-9)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("probes,clusters,window", [(1, 5, None), (2, 5, None), (3, 4, 9), (2, 7, 40)])
def test_routing_cross_equals_its_dense_definition(executor, padded, probes, clusters, window):
    q, k, v = memory_inputs()
    mask = memory_padding() if padded else None
    routes = cross_routes(q, k, centroids(clusters), probes, key_padding_mask=mask)
    out = routing_cross_attention(Inputs.cross(q, k, v, key_padding_mask=mask), routes, window, executor)
    allowed = routing_cross_mask(routes, window, mask)
    ref = reference_cross_attention(Inputs.cross(q, k, v, key_padding_mask=mask), allowed)
    close(out, ref, (q, k, v))
    w = min(NK, default_window(NK, clusters) if window is None else window)
    assert int(allowed.sum(-1).max()) <= probes * w  # at most p windows a query
    real = NK if mask is None else int(mask.sum(-1).min())
    fewest = default_window(real, clusters) if window is None else min(window, real)  # the shortest row's window
    assert int(allowed.sum(-1).min()) >= fewest  # a window is full where there are keys


def test_cross_routes_agree_on_every_executor():
    """The router's kernel (the fused executor's, with the memory's sort) and PyTorch's scores (tiles) choose the same
    clusters and probes, and the attention reads the same keys either way."""
    q, k, v = memory_inputs(8)
    got = {ex: cross_routes(q, k, centroids(6), 3, executor=ex) for ex in EXECUTORS}
    for ex in ("tiles", "flex"):
        assert torch.equal(got[ex].keys, got["fused"].keys) and torch.equal(got[ex].probes, got["fused"].probes)
        assert all(torch.equal(a, b) for a, b in zip(got[ex].sort[:3], got["fused"].sort[:3], strict=True))
    a = routing_cross_attention(Inputs.cross(q, k, v), got["fused"], None, "fused")
    b = routing_cross_attention(Inputs.cross(q, k, v), got["tiles"], None, "fused")
    assert torch.equal(a, b)


def test_routing_cross_windows_by_hand():
    """The definition itself, on a memory worked out by hand: sorted by (cluster, position) the keys are 1 4 8 | 3 7 |
    0 2 5 6 9. A cluster of at most ``window`` keys is read whole and then the keys after it in the sort; one of more
    keys its first ``window`` by position; a window that would run past the end is moved back."""
    keys = torch.tensor([[[2, 0, 2, 1, 0, 2, 2, 1, 0, 2]]])
    probes = torch.tensor([[[[0], [1], [2]]]])
    routes = CrossRoutes(keys, probes, 3)

    def read(window):
        return [row.nonzero().flatten().tolist() for row in routing_cross_mask(routes, window)[0, 0]]

    assert read(4) == [[1, 3, 4, 8], [0, 2, 3, 7], [0, 2, 5, 6]]
    assert read(6) == [[0, 1, 3, 4, 7, 8], [0, 2, 3, 5, 6, 7], [0, 2, 5, 6, 7, 9]]  # the last one moved back
    assert read(None) == read(4)  # ceil(10 / 3) = 4


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("options", [MobaOptions(block=8, top_k=2), MobaOptions(block=11, top_k=3, score="bound"),
                                     MobaOptions(top_k=1)])
def test_moba_cross_equals_its_dense_definition(executor, padded, options):
    q, k, v = memory_inputs(1)
    mask = memory_padding() if padded else None
    out = moba_cross_attention(Inputs.cross(q, k, v, key_padding_mask=mask), options, executor)
    allowed = moba_cross_mask(q, k, options, mask)
    close(out, reference_cross_attention(Inputs.cross(q, k, v, key_padding_mask=mask), allowed), (q, k, v))


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("padded", [False, True])
def test_full_linear_performer_cross_equal_their_dense_definitions(executor, padded):
    q, k, v = memory_inputs(2)
    mask = memory_padding() if padded else None
    inputs = Inputs.cross(q, k, v, key_padding_mask=mask)
    close(full_attention(inputs, None, executor, causal=False), reference_cross_attention(inputs), (q, k, v))
    for kernel in ("elu", "poly2"):
        out = linear_attention(inputs, LinearOptions(kernel=kernel), executor, causal=False)
        close(out, reference_cross_attention(inputs, kernel=kernel), (q, k, v))
    projection = orthogonal_features(H, 16, D, generator=torch.Generator().manual_seed(3)).double()
    out = performer_attention(inputs, None, executor, causal=False, projection=projection)
    phi_q = performer_features(q, projection, inputs.scale, query=True)  # the estimator's weights, written densely
    phi_k = performer_features(k, projection, inputs.scale, query=False)
    weights = phi_q @ phi_k.transpose(-1, -2)
    if mask is not None:
        weights = weights * mask[:, None, None, :]
    close(out, weights / weights.sum(-1, keepdim=True) @ v, (q, k, v))


def cross_kinds(executor: str):
    """Every kind that takes a memory, as one call each: (name, attend(inputs) -> out)."""
    projection = orthogonal_features(H, 16, D, generator=torch.Generator().manual_seed(3)).double()
    return [
        ("full", lambda i: full_attention(i, None, executor, causal=False)),
        ("routing", lambda i: routing_cross_attention(i, cross_routes(
            i.q, i.k, centroids(5), 2, key_padding_mask=None if i.key_valid is None else i.key_valid[:, 0]), None,
            executor)),
        ("moba", lambda i: moba_cross_attention(i, MobaOptions(block=8, top_k=2), executor)),
        ("linear", lambda i: linear_attention(i, None, executor, causal=False)),
        ("performer", lambda i: performer_attention(i, None, executor, causal=False, projection=projection)),
    ]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_memory_padding_changes_nothing(executor):
    """A memory padded with 9 keys of garbage, masked, gives what the memory alone gives, for every kind."""
    q, k, v = memory_inputs(3)
    garbage = torch.randn(B, H, 9, D, dtype=torch.float64) * 50
    mask = torch.ones(B, NK + 9, dtype=torch.bool)
    mask[:, NK:] = False
    for name, attend in cross_kinds(executor):
        alone = attend(Inputs.cross(q, k, v))
        padded = attend(Inputs.cross(q, torch.cat([k, garbage], 2), torch.cat([v, garbage], 2),
                                     key_padding_mask=mask))
        torch.testing.assert_close(padded, alone, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_query_reads_nothing_of_the_other_queries(executor):
    """A causal decoder may read a memory by any of these: query i's output is the same whatever the other queries
    are (no balancing over queries, no query statistics): bit for bit, or for routing and MoBA to an ulp (the other
    queries' ranges move the executor's tiles, and with them the order of a sum). The later queries are replaced by
    values ten times larger, so a real dependence would move the outputs by O(1)."""
    q, k, v = memory_inputs(4)
    changed = q.detach().clone()
    changed[:, :, 20:] = 10 * torch.randn(B, H, NQ - 20, D, dtype=torch.float64)  # every query after 19
    for name, attend in cross_kinds(executor):
        a = attend(Inputs.cross(q.detach(), k.detach(), v.detach()))
        b = attend(Inputs.cross(changed, k.detach(), v.detach()))
        ulp = 1e-14 if name in ("routing", "moba") else 0.0
        torch.testing.assert_close(a[:, :, :20], b[:, :, :20], rtol=0.0, atol=ulp, msg=name)
        assert not torch.allclose(a[:, :, 20:], b[:, :, 20:], rtol=0.0, atol=1e-3), name  # the changed ones moved


def test_kinds_that_compare_positions_refuse_a_memory():
    q, k, v = memory_inputs(5)
    inputs = Inputs.cross(q, k, v)
    calls = {
        "local": lambda: local_attention(inputs, LocalOptions(window=4), causal=False),
        "strided": lambda: strided_attention(inputs, StridedOptions(stride=4), causal=False),
        "fixed": lambda: fixed_attention(inputs, FixedOptions(block=8, summary=2), causal=False),
        "longformer": lambda: longformer_attention(inputs, LongformerOptions(window=4), causal=False),
        "lsh": lambda: lsh_attention(inputs, LSHOptions(buckets=4), causal=False),
        "full causal": lambda: full_attention(inputs, causal=True),
        "full rel": lambda: full_attention(inputs, causal=False, rel=rand_rel(D, 3)),
        "full poly2": lambda: full_attention(inputs, KernelOptions(kernel="poly2"), causal=False),
        "linear causal": lambda: linear_attention(inputs, causal=True),
        "performer causal": lambda: performer_attention(inputs, PerformerOptions(features=8), causal=True),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match="cross-attention: .*cross-attention kinds: full, routing, moba"):
            call()


def test_cross_inputs_and_routes_are_checked():
    q, k, v = memory_inputs(6)
    with pytest.raises(ValueError, match=r"k and v \(the memory\) must have shape"):
        Inputs.cross(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match=r"k and v \(the memory\) must have shape"):
        Inputs.cross(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, N\) = \(2, 53\)"):
        Inputs.cross(q, k, v, key_padding_mask=torch.ones(B, NQ, dtype=torch.bool))
    with pytest.raises(ValueError, match="same shape .* Inputs.cross"):
        Inputs.of(q, k, v)
    with pytest.raises(ValueError, match="probes .* at most the number of centroids"):
        cross_routes(q, k, centroids(3), probes=4)
    routes = cross_routes(q, k, centroids(3))
    with pytest.raises(ValueError, match="routes: keys must be"):
        routing_cross_attention(Inputs.cross(q, k[:, :, :9], v[:, :, :9]), routes)
    with pytest.raises(ValueError, match="warmup"):
        moba_cross_attention(Inputs.cross(q, k, v), MobaOptions(warmup=3))
    padded = Inputs.cross(q, k, v, key_padding_mask=memory_padding())
    with pytest.raises(ValueError, match="sort was made without padding or documents, the inputs come with padding"):
        routing_cross_attention(padded, cross_routes(q, k, centroids(3)))


def test_routed_cross_heads_attend_by_their_centroids_and_learn_from_the_real_memory_keys_only():
    import copy

    from routeformer.attention.routing.cross import RoutedCrossHeads

    q, k, v = memory_inputs(9)
    heads = RoutedCrossHeads(H, D, 5, probes=2).double().train()
    twin = copy.deepcopy(heads)
    out = heads(Inputs.cross(q, k, v))
    expected = routing_cross_attention(Inputs.cross(q, k, v), cross_routes(q, k, heads.kmeans.centroids, 2))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # the commitment term reaches the queries and the memory's keys
    grads = torch.autograd.grad(heads.aux_loss(), (q, k))
    assert all(float(g.abs().sum()) > 0 for g in grads)
    # a memory padded with garbage: the same output and the same k-means statistics
    garbage = torch.randn(B, H, 9, D, dtype=torch.float64) * 50
    mask = torch.ones(B, NK + 9, dtype=torch.bool)
    mask[:, NK:] = False
    padded = twin(Inputs.cross(q, torch.cat([k, garbage], 2), torch.cat([v, garbage], 2), key_padding_mask=mask))
    torch.testing.assert_close(padded, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(twin.kmeans.pending_sums, heads.kmeans.pending_sums, rtol=1e-12, atol=1e-12)
    assert torch.equal(twin.kmeans.pending_counts, heads.kmeans.pending_counts)
    torch.testing.assert_close(twin.aux_loss(), heads.aux_loss(), rtol=1e-12, atol=0)
    # the k-means step: seeded from the memory keys at the first update, then the routes follow the new centroids
    before = heads.kmeans.centroids.clone()
    assert heads.after_optimizer_step() and bool(heads.kmeans.initialized)
    assert not torch.equal(before, heads.kmeans.centroids)
    assert set(heads.replicated_state()) >= {"kmeans.centroids", "kmeans.ema_sums", "kmeans.ema_counts"}
    heads.eval()
    heads(Inputs.cross(q, k, v))
    assert heads.aux_loss() is None  # no loss in evaluation
    with pytest.raises(ValueError, match="reads a memory"):
        heads(Inputs.of(q, q, q))
    with pytest.raises(ValueError, match="probes .* at most num_clusters"):
        RoutedCrossHeads(H, D, 2, probes=3)


def test_routed_cross_heads_read_every_key_for_their_warm_up_then_route_and_resume_in_phase():
    from routeformer.attention.routing.cross import RoutedCrossHeads

    q, k, v = memory_inputs(10)
    x = Inputs.cross(q, k, v)
    heads = RoutedCrossHeads(H, D, 5, warmup=2).double().train()
    full = full_attention(x, None, "fused", causal=False)
    for _ in range(2):
        torch.testing.assert_close(heads(x), full, rtol=0, atol=0)  # every key, in training
        assert heads.aux_loss() is not None and bool(heads.kmeans.pending_counts.sum() > 0)  # the k-means observes
        heads.after_optimizer_step()
    assert int(heads.steps) == 2 and not heads.warming_up
    routed = routing_cross_attention(x, cross_routes(q, k, heads.kmeans.centroids, 1))
    torch.testing.assert_close(heads(x), routed, rtol=0, atol=0)
    assert not torch.allclose(routed, full)
    # a copy loaded mid-warm-up goes on in the same phase, and evaluation and decoding follow the phase too
    early = RoutedCrossHeads(H, D, 5, warmup=3).double()
    late = RoutedCrossHeads(H, D, 5, warmup=3).double()
    early.after_optimizer_step()
    late.load_state_dict(early.state_dict())
    assert int(late.steps) == 1 and late.warming_up
    late.eval()
    torch.testing.assert_close(late(x), full, rtol=0, atol=0)
    torch.testing.assert_close(late.decode(x, late.prepare(k, v)), full, rtol=0, atol=0)
    assert "steps" not in RoutedCrossHeads(H, D, 5).state_dict()  # no warm-up: the state of before
    with pytest.raises(ValueError, match="warmup"):
        RoutedCrossHeads(H, D, 5, warmup=-1)
