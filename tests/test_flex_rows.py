"""The flex executor's row mover (``executors/flex/rows.py``: ``kernels.move`` behind ``routeformer_flex::move_rows``)
against PyTorch's indexing, and ``move_rows``'s gradient through it.

Like the router's kernels (tests/test_flex_router.py) it runs on CUDA tensors where there is a GPU, else on CPU
tensors under Triton's interpreter (CI's line ``TRITON_INTERPRET=1 python -m pytest -n 0 tests/test_flex_router.py
tests/test_flex_rows.py``); without either these tests skip."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the row mover's Triton kernel runs on CUDA, or on the CPU with TRITON_INTERPRET=1 set before Triton is "
           "imported (the triton extra)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("B, H, N, M, D, scale", [(1, 2, 100, 100, 8, 1.0), (2, 3, 70, 90, 24, 0.5),
                                                  (1, 1, 130, 5, 64, 1.0)])
def test_the_kernel_moves_rows_as_indexing(B: int, H: int, N: int, M: int, D: int, scale: float,
                                           dtype: torch.dtype) -> None:
    """Rows of a non-contiguous x (a projection's heads, (B, N, H, D) seen as (B, H, N, D)) picked by an index
    with entries past N - 1 (read as row N - 1), scaled: exactly PyTorch's indexing times the scale, rounded once
    to the dtype."""
    from routeformer.executors.flex import rows

    g = torch.Generator().manual_seed(B * 1000 + N + M)
    x = torch.randn(B, N, H, D, generator=g).to(dtype).transpose(1, 2)  # (B, H, N, D), strides of (B, N, H, D)
    index = torch.randint(0, N + 3, (B, H, M), generator=g)
    got = rows.launch(x.to(DEVICE), index.to(DEVICE), scale).cpu()
    b, h = torch.arange(B)[:, None, None], torch.arange(H)[None, :, None]
    want = (x[b, h, index.clamp_max(N - 1)].double() * scale).to(dtype)
    assert got.shape == (B, H, M, D) and got.is_contiguous()
    assert torch.equal(got, want)


def test_move_rows_sorts_and_unsorts_with_its_gradient_on_the_kernel() -> None:
    """``move_rows`` with a permutation and the kernel (``flex.rows.moved`` on CUDA; its body under the
    interpreter): the forward is x's rows in that order and the gradient grad_out's rows put back, as with
    PyTorch's gather."""
    from routeformer.executors import rows as rows_module
    from routeformer.executors.flex import rows

    kernel = rows.moved if CUDA else rows.launch
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 50, 16, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    order = torch.rand(2, 3, 50, generator=g).argsort(-1).to(DEVICE)
    inverse = torch.empty_like(order).scatter_(-1, order, torch.arange(50, device=DEVICE).expand_as(order))
    out = rows_module.move_rows(x, order, inverse, unreached=False, scale=2.0, kernel=kernel)
    grad = torch.randn(2, 3, 50, 16, generator=g, dtype=torch.float64).to(DEVICE)
    (dx,) = torch.autograd.grad(out, x, grad)
    want = x.detach().gather(2, order[..., None].expand(-1, -1, -1, 16)) * 2.0
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    torch.testing.assert_close(dx, 2.0 * grad.gather(2, inverse[..., None].expand(-1, -1, -1, 16)), rtol=0, atol=0)


@pytest.mark.parametrize("probes", [2, 3])
def test_multi_probe_routing_is_the_same_with_the_row_kernel(monkeypatch, probes: int) -> None:
    """A multi-probe routing layer on the flex executor (its ranges: the keys sorted, the queries spread into slots,
    the slots merged) with the flex row kernel doing every move and gather (its body, launched directly: under the
    interpreter on the CPU) and with PyTorch's gathers (the kernel declining every tensor, as on the CPU): the same
    output and gradients, on either device. In float64 on the CPU (FlexAttention's eager operator); in float32 on
    CUDA, where FlexAttention compiles, and not for float64, which no user runs there (a compilation that took
    device minutes for nothing)."""
    from routeformer.attention.routing import RoutingAttention, RoutingOptions
    from routeformer.executors import get_executor
    from routeformer.executors.flex import ranges, rows

    dtype, tol = (torch.float32, 1e-5) if CUDA else (torch.float64, 1e-12)
    g = torch.Generator().manual_seed(probes)
    q, v = (torch.randn(2, 2, 300, 16, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    layer = RoutingAttention(2, 16, RoutingOptions(num_clusters=6, window=20, probes=probes)).to(dtype).eval()
    layer.executor = get_executor("flex")
    results = []
    for kernel in (False, True):
        monkeypatch.setattr(ranges, "moved", rows.launch if kernel else lambda x, index, scale: None)
        x = [t.clone().to(DEVICE).requires_grad_() for t in (q, v)]
        out = layer.to(DEVICE)(x[0], x[0], x[1])
        results.append((out.detach(), *torch.autograd.grad(out.square().sum(), x)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)

