"""The router's unit routing vectors as a fused operator (``routeformer_fused::route_vectors`` and its backward,
executors/fused/vectors.py) against the definition it stands in for, ``F.normalize`` then the per-head einsum with
W_R: the same vectors and gradients in float64 (zero and sub-eps rows, strided rows, D not a multiple of the lanes,
several row runs per head), float32 within rounding, gradcheck, the same bits for every thread count, errors that
name the argument, no double backward; and the router taking it for shared, joint and separate routing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from routeformer.attention.routing.options import RoutingOptions
from routeformer.attention.routing.router import Router
from routeformer.executors import get_executor
from routeformer.executors.fused import available
from routeformer.executors.fused.vectors import EPS, fused_routing_vectors

pytestmark = pytest.mark.skipif(not available(), reason="the fused kernels are not built here")


def _turn(H: int, D: int, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(H, D, D, generator=g, dtype=torch.float64))[0].to(dtype).contiguous()


def _definition(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bhnd,hde->bhne", F.normalize(x, dim=-1), turn)


def _both(x: torch.Tensor, turn: torch.Tensor, grad: torch.Tensor):
    """(r, ∂L/∂x) of the kernel and of the definition for L = <r, grad>."""
    out = []
    for f in (fused_routing_vectors, _definition):
        leaf = x.detach().clone().requires_grad_()
        r = f(leaf, turn)
        (dx,) = torch.autograd.grad(r, leaf, grad)
        out.append((r.detach(), dx))
    return out


@pytest.mark.parametrize("N, D", [(300, 64), (129, 20), (7, 1), (1, 16)])
def test_vectors_and_gradients_are_the_definitions_in_float64(N: int, D: int) -> None:
    """N = 300: three runs of rows per head (a run is 128 rows); D = 20, 1: tails of the vector lanes. A zero row
    and a row shorter than eps are divided by eps, as F.normalize divides them (their gradient is the clamp's)."""
    B, H = 2, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    x[0, 1, 0] = 0.0
    x[1, 2, N - 1] = 1e-3 * EPS
    grad = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    (r, dx), (r_ref, dx_ref) = _both(x, _turn(H, D), grad)
    torch.testing.assert_close(r, r_ref, rtol=1e-13, atol=1e-15)
    scale = dx_ref.abs().amax(-1, keepdim=True).clamp_min(1.0)  # the sub-eps rows' gradients are ~1e12
    torch.testing.assert_close(dx / scale, dx_ref / scale, rtol=0, atol=1e-13)
    assert dx[0, 1, 0].abs().max() > 1e6  # a zero row's gradient is u / eps, not 0


def test_strided_rows_are_read_in_place() -> None:
    """The (B, N, H, D) layout a projection makes, read as (B, H, N, D): rows D apart times H."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 150, 3, 16, generator=g, dtype=torch.float64).transpose(1, 2)
    grad = torch.randn(2, 3, 150, 16, generator=g, dtype=torch.float64).transpose(1, 2).contiguous().transpose(1, 2)
    (r, dx), (r_ref, dx_ref) = _both(x, _turn(3, 16), grad)
    torch.testing.assert_close(r, r_ref, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-14)


def test_float32_is_within_rounding_of_float64() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 200, 64, generator=g, dtype=torch.float64)
    grad = torch.randn(1, 2, 200, 64, generator=g, dtype=torch.float64)
    turn = _turn(2, 64)
    (r64, dx64), _ = _both(x, turn, grad)
    (r32, dx32), _ = _both(x.float(), turn.float(), grad.float())
    torch.testing.assert_close(r32.double(), r64, rtol=0, atol=2e-6)
    torch.testing.assert_close(dx32.double(), dx64, rtol=1e-5, atol=2e-6)


def test_gradcheck() -> None:
    x = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    turn = _turn(2, 3)
    assert torch.autograd.gradcheck(lambda t: fused_routing_vectors(t, turn), (x,))


def test_the_same_bits_for_every_thread_count() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 517, 24, generator=g)
    grad = torch.randn(2, 2, 517, 24, generator=g)
    turn = _turn(2, 24, torch.float32)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_both(x, turn, grad)[0])
    finally:
        torch.set_num_threads(threads)
    for r, dx in runs[1:]:
        assert torch.equal(r, runs[0][0]) and torch.equal(dx, runs[0][1])


def test_no_rows_and_no_heads() -> None:
    for shape in ((2, 3, 0, 8), (0, 3, 4, 8)):
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        r = fused_routing_vectors(x, _turn(3, 8))
        assert r.shape == shape
        r.sum().backward()
        assert x.grad.shape == shape


def test_errors_name_the_argument() -> None:
    x = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    turn = _turn(2, 4)
    ops = torch.ops.routeformer_fused
    with pytest.raises(RuntimeError, match=r"route_vectors: projection must be \(H, D, D\) = \(2, 4, 4\)"):
        ops.route_vectors(x, turn[:1], EPS)
    with pytest.raises(RuntimeError, match=r"route_vectors: projection must be Double"):
        ops.route_vectors(x, turn.float(), EPS)
    with pytest.raises(RuntimeError, match=r"route_vectors: eps must be positive and finite, got 0"):
        ops.route_vectors(x, turn, 0.0)
    with pytest.raises(RuntimeError, match=r"route_vectors: x must be 4-D"):
        ops.route_vectors(x[0], turn, EPS)
    with pytest.raises(RuntimeError, match=r"route_vectors: x must be float32 or float64"):
        ops.route_vectors(x.half(), turn, EPS)
    r, norm = ops.route_vectors(x, turn, EPS)
    with pytest.raises(RuntimeError, match=r"route_vectors_backward: grad_r must be \(B, H, N, D\)"):
        ops.route_vectors_backward(r[:, :, :4], x, norm, turn, EPS)
    with pytest.raises(RuntimeError, match=r"route_vectors_backward: norm must be \(B, H, N\)"):
        ops.route_vectors_backward(r, x, norm[..., :4], turn, EPS)


def test_no_double_backward() -> None:
    x = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    r = fused_routing_vectors(x, _turn(2, 4))
    (dx,) = torch.autograd.grad(r.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="routing vectors backward is not differentiable"):
        dx.sum().backward()


def test_the_executor_declines_what_the_kernel_does_not_take() -> None:
    """bfloat16 goes to PyTorch's operators: the fused executor's runner for it is tiles, which has no
    ``vectors_run`` (asked once, there); the kernel itself names the dtype; a projection that asks for a gradient
    is declined (the caller's autograd path gives it one)."""
    turn = _turn(2, 4)
    x = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16)
    assert get_executor("fused").runner(x).vectors_run is None
    with pytest.raises(RuntimeError, match="route_vectors: x must be float32 or float64, got BFloat16"):
        fused_routing_vectors(x, turn)
    assert fused_routing_vectors(torch.randn(1, 2, 3, 4, dtype=torch.float64), turn.requires_grad_()) is None


@pytest.mark.parametrize("shared_qk, separate", [(True, False), (False, False), (False, True)])
def test_the_router_turns_its_vectors_in_the_kernel(shared_qk: bool, separate: bool) -> None:
    """Shared QK (one call), joint (one call, on n(q) + n(k)) and separate routing (a call for the queries and one
    for the keys) take the executor's vectors in ``routes``: the same vectors, key clusters and gradients as
    PyTorch's operators give (``query_and_key_vectors``, the definition, and an executor without the kernel)."""
    calls = []
    fused = get_executor("fused")
    counted = dataclasses.replace(fused, vectors_run=lambda *a: calls.append(1) or fused_routing_vectors(*a))
    options = RoutingOptions(num_clusters=4, window=4, probes=1, balance=0.0, shared_qk=shared_qk, separate=separate)
    router = Router(2, 8, options).double()
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(2, 2, 40, 8, generator=g, dtype=torch.float64)
    got = []
    for executor in (counted, dataclasses.replace(fused, vectors_run=None)):
        leaves = [t.clone().requires_grad_() for t in (q, k)]
        routes = router.routes(leaves[0], leaves[0] if shared_qk else leaves[1], executor=executor)
        (routes.vectors * weight).sum().backward()
        got.append([routes.vectors.detach(), routes.keys, *(t.grad for t in leaves)])
    assert len(calls) == (2 if separate else 1)
    torch.testing.assert_close(got[0][0], router.query_and_key_vectors(q, q if shared_qk else k)[0], rtol=1e-12,
                               atol=1e-14)
    for a, b in zip(*got, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert get_executor("tiles").vectors_run is None
