"""The causal scan with a recomputing backward (attention/feature_scan.py, and the fused executor's C++ operator,
tests/test_fused_scan.py), Performer's and linear attention's feature maps, against autograd through
``feature_attention`` (the chunked form, itself tested against the quadratic
definition in test_kinds.py), in float64: outputs, gradients, padded keys, any chunk, no leak, and what autograd
keeps."""

import pytest
import torch

from helpers import assert_close_with_grads, feature_inputs, feature_map, fused_scan
from routeformer.attention import Inputs, LinearOptions
from routeformer.attention.feature_scan import feature_scan
from routeformer.attention.linear import EluFeatures, feature_attention, linear_attention
from routeformer.attention.performer import (
    PerformerFeatures,
    orthogonal_features,
    performer_attention,
)

B, H, N, D, M = 2, 3, 37, 8, 12
SCALE = 0.3


def _inputs(seed=0, dtype=torch.float64, shape=(B, H, N, D)):
    return feature_inputs(seed, shape, M, dtype)


def _fmap(name, w):
    return feature_map(name, w, SCALE)


def _autograd(q, k, v, fmap, chunk, valid):
    return feature_attention(fmap(q, query=True), fmap(k, query=False), v, causal=True, chunk=chunk, key_valid=valid)


def performer_scan(q, k, v, w, scale, chunk, valid):
    return feature_scan(q, k, v, PerformerFeatures(w, scale), chunk, valid)


def _scan(name: str):
    """The scan under test: the PyTorch definition (``feature_scan``) or the fused executor's C++ operator."""
    if name == "pytorch":
        return feature_scan
    from routeformer.executors.fused import available

    if not available():
        pytest.skip("the fused kernels are not built here")
    return fused_scan


@pytest.mark.parametrize("scan", ["pytorch", "fused"])
@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 64])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("features", ["performer", "elu"])
def test_scan_equals_autograd_float64(chunk, padded, features, scan):
    q, k, v, w, valid = _inputs()
    valid = valid if padded else None
    fmap = _fmap(features, w)
    ref = _autograd(q, k, v, fmap, chunk, valid)
    out = _scan(scan)(q, k, v, fmap, chunk, valid)
    assert_close_with_grads(out, ref, (q, k, v), rtol=1e-12, atol=1e-12, grad_rtol=1e-10, grad_atol=1e-12)


@pytest.mark.parametrize("features", ["performer", "elu"])
def test_gradcheck(features):
    q, k, v, w, valid = _inputs(1, shape=(1, 2, 13, 4))  # small: gradcheck perturbs every input element
    fmap = _fmap(features, w)
    assert torch.autograd.gradcheck(lambda a, b, c: feature_scan(a, b, c, fmap, 5, valid), (q, k, v), fast_mode=True)


def test_float32_within_rounding_of_float64():
    q, k, v, w, valid = _inputs(2)
    ref = performer_scan(q, k, v, w, SCALE, 8, valid)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = performer_scan(q32, k32, v32, w.float(), SCALE, 8, valid)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scan", ["pytorch", "fused"])
@pytest.mark.parametrize("features", ["performer", "elu"])
def test_no_leak_forward_or_backward(features, scan):
    """Outputs before t and the gradients reaching inputs before t from the outputs before t do not move when
    everything after t is redrawn."""
    q, k, v, w, _ = _inputs(3)
    fmap, run = _fmap(features, w), _scan(scan)
    t = 20
    q2, k2, v2 = (torch.cat([x.detach()[:, :, :t], torch.randn_like(x[:, :, t:]) * 3], 2).requires_grad_()
                  for x in (q, k, v))
    a = run(q, k, v, fmap, 8, None)
    b = run(q2, k2, v2, fmap, 8, None)
    assert torch.equal(a[:, :, :t], b[:, :, :t])
    grad = torch.randn_like(a[:, :, :t])
    ga = torch.autograd.grad(a[:, :, :t], (q, k, v), grad)
    gb = torch.autograd.grad(b[:, :, :t], (q2, k2, v2), grad)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x[:, :, :t], y[:, :, :t], rtol=1e-12, atol=1e-13)
        assert x[:, :, t:].abs().max() == 0 and y[:, :, t:].abs().max() == 0


def _kept_bytes(fn) -> int:
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_performer_and_linear_attention_keep_at_most_five_q():
    """The public functions take the scan: autograd keeps q, k, v, the output and a row of denominators (the issue's
    goal: <= 5x q's bytes), where autograd through feature_attention keeps the (N, F) features and chunk states."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 512, 16, generator=gen).requires_grad_() for _ in range(3))
    w = orthogonal_features(2, 44, 16, generator=gen)
    q_bytes = q.numel() * q.element_size()
    scan = _kept_bytes(lambda: performer_attention(Inputs.of(q, k, v), projection=w))
    chunked = _kept_bytes(lambda: performer_attention(Inputs.of(q, k, v), projection=w.clone().requires_grad_()))
    assert scan <= 5 * q_bytes < chunked
    elu = _kept_bytes(lambda: linear_attention(Inputs.of(q, k, v), LinearOptions(kernel="elu")))
    fmap = EluFeatures()
    elu_chunked = _kept_bytes(lambda: _autograd(q, k, v, fmap, 64, None))
    assert elu <= 5 * q_bytes < elu_chunked


def test_projection_with_a_gradient_takes_autograd():
    q, k, v, w, valid = _inputs(5)
    w = w.clone().requires_grad_()
    out = performer_attention(Inputs.of(q, k, v, scale=SCALE), projection=w, chunk=8)
    (gw,) = torch.autograd.grad(out.square().sum(), (w,))
    assert gw.abs().max() > 0
    torch.testing.assert_close(out, performer_scan(q, k, v, w.detach(), SCALE, 8, None))
