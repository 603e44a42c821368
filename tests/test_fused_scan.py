"""The fused feature scan (``routeformer_fused::feature_scan_*``, executors/fused/scan.py): causal elu linear attention
and Performer through their features as one C++ operator each way, against autograd through the chunked form (in
tests/test_feature_scan.py, beside the PyTorch scan it stands in for, with the leak test) and here against the
quadratic definition in float64, gradcheck; the same bits for every thread count; the public functions and heads
taking it on the CPU's executor and not on the tiles one; errors that name the argument."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import assert_close_with_grads, feature_inputs, feature_map, fused_scan
from routeformer.attention import Inputs, LinearOptions
from routeformer.attention.kernels import kernel_attention
from routeformer.attention.linear import EluFeatures, linear_attention
from routeformer.attention.performer import performer_attention
from routeformer.executors import get_executor
from routeformer.executors.fused import available
from routeformer.executors.fused.scan import fused_feature_scan
from routeformer.executors.tiling import FeatureKernel

pytestmark = pytest.mark.skipif(not available(), reason="the fused kernels are not built here")

SCALE = 0.3


def _inputs(seed=0, shape=(2, 3, 37, 8), m=12, dtype=torch.float64):
    return feature_inputs(seed, shape, m, dtype)


def _fmap(name, w):
    return feature_map(name, w, SCALE)


def test_fused_elu_equals_the_quadratic_definition_float64():
    """Against softmax-free attention written out: weights φ(q)·φ(k) over j <= i, normalised (kernels.py)."""
    q, k, v, _, valid = _inputs(1)
    out = fused_scan(q, k, v, EluFeatures(), 8, valid)
    ref = kernel_attention(Inputs.of(q, k, v, key_padding_mask=valid[:, 0]), "elu", causal=True)
    assert_close_with_grads(out, ref, (q, k, v), rtol=1e-10, atol=1e-12, grad_rtol=1e-9, grad_atol=1e-11)


@pytest.mark.parametrize("features", ["performer", "elu"])
def test_fused_gradcheck(features):
    q, k, v, w, valid = _inputs(2, shape=(1, 2, 13, 4))
    fmap = _fmap(features, w)
    assert torch.autograd.gradcheck(lambda a, b, c: fused_scan(a, b, c, fmap, 5, valid), (q, k, v), fast_mode=True)


@pytest.mark.parametrize("features", ["performer", "elu"])
def test_fused_float32_within_rounding_of_float64(features):
    q, k, v, w, valid = _inputs(3, shape=(2, 2, 300, 16), m=40)
    fmap = _fmap(features, w)
    ref = fused_scan(q, k, v, fmap, 64, valid)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = fused_scan(q32, k32, v32, _fmap(features, w.float()), 64, valid)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("features", ["performer", "elu"])
def test_fused_scan_the_same_bits_for_every_thread_count(features):
    q, k, v, w, valid = _inputs(5, shape=(2, 3, 200, 16), m=24, dtype=torch.float32)
    fmap = _fmap(features, w)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = fused_scan(q, k, v, fmap, 32, valid)
            runs.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


def test_the_public_functions_take_the_kernels_on_the_cpu_executor_only():
    """linear_attention (elu) and performer_attention reach the executor's scan: the fused one's kernels by
    default on the CPU, the PyTorch scan on the tiles executor (no C++), the same values within rounding; a
    projection that asks for a gradient is not taken (autograd's path gives it one)."""
    q, k, v, w, valid = _inputs(7)
    calls = []
    fused = get_executor("fused")
    counted = dataclasses.replace(fused, scan_run=lambda *a: calls.append(1) or fused_feature_scan(*a))
    inputs = Inputs.of(q, k, v, key_padding_mask=valid[:, 0])
    elu = linear_attention(inputs, LinearOptions("elu"), counted)
    assert len(calls) == 1
    torch.testing.assert_close(elu, linear_attention(inputs, LinearOptions("elu"), "tiles"), rtol=1e-12, atol=1e-12)
    perf = performer_attention(inputs, None, counted, projection=w)
    assert len(calls) == 2
    torch.testing.assert_close(perf, performer_attention(inputs, None, "tiles", projection=w), rtol=1e-12,
                               atol=1e-12)
    assert get_executor("tiles").scan_run is None
    trained = w.clone().requires_grad_()
    assert fused_feature_scan(q, k, v, FeatureKernel(trained, SCALE), 8, None) is None


def test_a_model_of_linear_and_performer_heads_runs_on_the_kernels():
    """backend='tiles' runs the PyTorch scan, the default the kernels: the same logits and gradients (float64)."""
    from routeformer import TransformerConfig, TransformerLM

    logits, grads = [], []
    for backend in ("auto", "tiles"):
        config = TransformerConfig(vocab_size=17, dim=32, depth=1, heads=4, seq_len=40,
                                   attention="linear:2,performer:2", positions="absolute", backend=backend)
        torch.manual_seed(0)
        model = TransformerLM(config).double()
        tokens = torch.randint(0, 17, (2, 40), generator=torch.Generator().manual_seed(1))
        out = model(tokens)
        out.square().mean().backward()
        logits.append(out.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-10, atol=1e-12)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


def test_errors_name_the_argument():
    q, k, v, w, valid = (x.detach() if isinstance(x, torch.Tensor) else x for x in _inputs(8))
    scan = torch.ops.routeformer_fused.feature_scan_forward
    with pytest.raises(RuntimeError, match=r"feature_scan_forward: chunk must be >= 1, got 0"):
        scan(q, k, v, None, None, None, 0, 1.0)
    with pytest.raises(RuntimeError, match=r"feature_scan_forward: projection must be \(H, m, D\)"):
        scan(q, k, v, None, w[:1], None, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"feature_scan_forward: scale must be positive"):
        scan(q, k, v, None, w, None, 4, 0.0)
    with pytest.raises(RuntimeError, match=r"feature_scan_forward: k must be \(B, H, N, D\) like q"):
        scan(q, k[:, :, :5], v, None, None, None, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"feature_scan_forward: v must be contiguous"):
        scan(q, k, v.transpose(2, 3).contiguous().transpose(2, 3), None, None, None, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"feature_scan_forward: key_valid must be"):
        scan(q, k, v, valid[:1], None, None, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"feature_scan_forward: documents must be \(B, N\)"):
        scan(q, k, v, None, None, torch.zeros(1, 3, dtype=torch.long), 4, 1.0)
    with pytest.raises(RuntimeError, match=r"feature_scan_forward: documents must be"):
        scan(q, k, v, None, None, torch.zeros(q.shape[0], q.shape[2]), 4, 1.0)
