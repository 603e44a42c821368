"""Incremental decoding reproduces the causal forward, token by token and after a prompt."""

from __future__ import annotations

import pytest
import torch

from helpers import rand_qkv, rand_rel, routing_layer


@pytest.mark.parametrize("shared, separate, probes, gate", [
    (True, False, 1, False), (False, False, 1, False), (False, True, 1, False),
    (True, False, 3, False), (False, True, 2, False), (True, False, 2, True),
])
@pytest.mark.parametrize("rel", [False, True])
@pytest.mark.parametrize("clusters, window", [(3, 4), (16, 8), (1, 200)])
def test_decoding_equals_the_forward(shared: bool, separate: bool, probes: int, gate: bool, rel: bool, clusters: int,
                                     window: int) -> None:
    B, H, N, D = 2, 3, 150, 16
    probes = min(probes, clusters)
    layer = routing_layer(H, D, clusters, window, causal=True, shared_qk=shared, separate=separate,
                             probes=probes, balance=0.01, gate=gate).eval()
    with torch.no_grad():  # a bias as training leaves it
        layer.routing.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    q, k, v = rand_qkv(B, H, N, D, dtype=torch.float32, grad=False)
    k = q if shared else k
    rp = rand_rel(D, 12, dtype=torch.float32) if rel else None
    full = layer(q, k, v, rel_pos=rp)
    cache = layer.new_cache(B, N)
    prompt = 40  # a prompt through the forward, then one token at a time, well past `window`
    out = [layer.decode(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], cache, rel_pos=rp)]
    out += [layer.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache, rel_pos=rp)
            for t in range(prompt, N)]
    torch.testing.assert_close(torch.cat(out, 2), full, rtol=0, atol=1e-5)
    assert cache.length == N


def test_token_by_token_from_the_start() -> None:
    layer = routing_layer(2, 8, 5, 3, causal=True).eval()
    q, _, v = rand_qkv(1, 2, 30, 8, dtype=torch.float32, grad=False)
    cache = layer.new_cache(1, 30)
    steps = torch.cat([layer.decode(q[:, :, t:t + 1], q[:, :, t:t + 1], v[:, :, t:t + 1], cache)
                       for t in range(30)], 2)
    torch.testing.assert_close(steps, layer(q, q, v), rtol=0, atol=1e-5)


@pytest.mark.parametrize("prompt", [50, 20, 1])
def test_the_cache_holds_the_last_window_positions_of_each_cluster(prompt: int) -> None:
    """After a prompt (filled at once) and single tokens: cluster c's buffer holds exactly the last min(window, n_c)
    positions routed to c, with their keys and values."""
    B, H, N, D, kc, window = 2, 2, 50, 8, 4, 3
    layer = routing_layer(H, D, kc, window, causal=True).eval()
    q, _, v = rand_qkv(B, H, N, D, dtype=torch.float32, grad=False)
    cache = layer.new_cache(B, N)
    layer.decode(q[:, :, :prompt], q[:, :, :prompt], v[:, :, :prompt], cache)
    for t in range(prompt, N):
        layer.decode(q[:, :, t:t + 1], q[:, :, t:t + 1], v[:, :, t:t + 1], cache)
    assert cache.keys.shape == (B, H, kc, window, D)
    clusters = layer.routing.route(q, q)
    for b in range(B):
        for h in range(H):
            for c in range(kc):
                routed = (clusters[b, h] == c).nonzero().flatten().tolist()
                slots = (cache.positions[b, h, c] >= 0).nonzero().flatten()
                held = cache.positions[b, h, c, slots]
                assert sorted(held.tolist()) == routed[-window:], (b, h, c)
                assert torch.equal(cache.keys[b, h, c, slots], q[b, h, held])
                assert torch.equal(cache.values[b, h, c, slots], v[b, h, held])
                assert int(cache.counts[b, h, c]) == len(routed)
    assert len(torch.unique(clusters)) == kc  # every cluster is exercised


def test_decoding_past_the_declared_maximum_is_an_error() -> None:
    layer = routing_layer(2, 8, 4, 3, causal=True).eval()
    q, _, v = rand_qkv(1, 2, 6, 8, dtype=torch.float32, grad=False)
    cache = layer.new_cache(1, 5)
    with pytest.raises(ValueError, match="max_len"):
        layer.decode(q, q, v, cache)
    layer.decode(q[:, :, :5], q[:, :, :5], v[:, :, :5], cache)
    with pytest.raises(ValueError, match="max_len"):
        layer.decode(q[:, :, 5:], q[:, :, 5:], v[:, :, 5:], cache)


def test_decoding_needs_a_causal_layer() -> None:
    with pytest.raises(ValueError, match="causal"):
        routing_layer(2, 8, 4, 3, causal=False).new_cache(1, 10)
