"""An encoder's heads (issue 73): the kinds with a non-causal form (``HeadKind.encoder``) see the whole sequence,
equal their functions with ``causal=False`` and their dense definitions, honour the source's padding (no query reads
a padded key, no statistic counts one), and the kinds without one are refused by name."""

from __future__ import annotations

import pytest
import torch

from routeformer.attention import (
    Inputs,
    LocalOptions,
    full_attention,
    local_attention,
    performer_attention,
    reference_attention,
)
from routeformer.attention.full import full_mask
from routeformer.attention.local import local_mask
from routeformer.model import TransformerConfig
from routeformer.model.layers import MixedAttention

ENCODER = "full:1,local:1,routing:1,linear:1,performer:1"
N = 48


def encoder_layer(attention: str = ENCODER, heads: int = 5, causal: bool = False) -> MixedAttention:
    config = TransformerConfig(vocab_size=256, dim=8 * heads, heads=heads, seq_len=64, attention=attention,
                               positions="none", options={"local": {"window": 8},
                                                          "routing": {"num_clusters": 4, "window": 12, "probes": 1,
                                                                      "balance": 0.0}})
    torch.manual_seed(0)
    return MixedAttention(config, config.head_groups()[0], 0, causal=causal).double()


def qkv(seed: int, n: int = N):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 1, n, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def padding(n: int = N) -> torch.Tensor:
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n - 11:] = False  # the second source is shorter
    return mask


def test_each_encoder_kind_equals_its_non_causal_definition() -> None:
    layer = encoder_layer()
    full, local, routing, linear, performer = layer.groups
    q, k, v = qkv(1)
    mask = padding()
    x = Inputs.of(q, k, v, key_padding_mask=mask)
    everything = full_mask(N, causal=False)
    expected = {
        "full": reference_attention(x, everything),
        "local": reference_attention(x, local_mask(N, 8, causal=False)),
        "routing": reference_attention(x, routing.routing_mask(q, k, mask)),
        "linear": reference_attention(Inputs.of(q, k, v, key_padding_mask=mask), everything, kernel="elu"),
        "performer": performer_attention(x, None, causal=False, projection=performer.projection),
    }
    for name, group in zip(expected, layer.groups, strict=True):
        assert not group.causal, name
        out = group(q, k, v, None, key_padding_mask=mask)
        torch.testing.assert_close(out, expected[name], rtol=1e-9, atol=1e-10, msg=name)
    # the same as the public functions called non-causal
    torch.testing.assert_close(full(q, k, v, None, key_padding_mask=mask), full_attention(x, causal=False))
    torch.testing.assert_close(local(q, k, v, None, key_padding_mask=mask),
                               local_attention(x, LocalOptions(window=8), causal=False))


def test_an_encoder_position_reads_later_positions() -> None:
    layer = encoder_layer()
    q, k, v = qkv(2)
    later = [t.clone() for t in (q, k, v)]
    for t in later:
        t[:, :, 1:] = torch.randn_like(t[:, :, 1:])  # every position after the first
    for group in layer.groups:
        a, b = group(q, k, v, None), group(*later, None)
        assert not torch.allclose(a[:, :, 0], b[:, :, 0]), type(group).__name__


def test_the_source_padding_changes_nothing() -> None:
    """A row padded with garbage gives its real positions what the row alone gives, and routing's k-means counts the
    same real keys."""
    layer = encoder_layer().train()
    twin = encoder_layer().train()
    twin.load_state_dict(layer.state_dict())
    real = N - 11
    x = torch.randn(2, N, 40, dtype=torch.float64)
    x[1, real:] = 50 * torch.randn(N - real, 40, dtype=torch.float64)  # garbage where row 1 is padded
    out, _ = layer(x, key_padding_mask=padding())
    alone, _ = twin(x[1:, :real])
    torch.testing.assert_close(out[1, :real], alone[0], rtol=1e-10, atol=1e-10)
    routing = layer.groups[2].routing.kmeans
    alone_counts = twin.groups[2].routing.kmeans.pending_counts
    row0 = encoder_layer().train()
    row0.load_state_dict(layer.state_dict())
    row0(x[:1])
    both = alone_counts + row0.groups[2].routing.kmeans.pending_counts
    torch.testing.assert_close(routing.pending_counts, both)  # row 1's padding counted nowhere


def test_kinds_without_an_encoder_form_are_refused() -> None:
    with pytest.raises(ValueError, match="encoder: moba heads have no non-causal .*encoder kinds: full, local, "
                                         "routing"):
        encoder_layer("local:2,moba:2", heads=4)
    causal = encoder_layer("full:1,local:1,linear:1,performer:1,routing:1", causal=True)  # a decoder's layer
    with pytest.raises(ValueError, match="key_padding_mask: a causal layer needs none"):
        causal(torch.randn(2, N, 40, dtype=torch.float64), key_padding_mask=padding())
