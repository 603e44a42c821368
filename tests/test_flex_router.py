"""The flex executor's router (``executors/flex/router.py``: Triton kernels behind ``routeformer_flex::route``)
against the PyTorch router it stands in for, and a whole routing forward and backward counted on the ``meta``
device.

The kernels run on CUDA tensors where there is a GPU, else on CPU tensors under Triton's interpreter, which must be
on before Triton is first imported (a jit function reads it when it is made): CI's own line, ``TRITON_INTERPRET=1
python -m pytest -n 0 tests/test_flex_router.py``, with the ``triton`` extra installed (slow: small sizes). Without
either those tests skip; the operator count and the commitment term need no Triton and run in the default suite."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import OperatorCount, rand_padding
from routeformer.attention.routing import RoutingAttention, RoutingOptions
from routeformer.attention.routing.sorted_window import sort_by_cluster
from routeformer.executors import get_executor
from routeformer.executors.flex import ops as flex_ops
from routeformer.executors.flex import router as flex_router

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
kernels = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (CUDA or INTERPRETED),
    reason="the router's Triton kernels run on CUDA, or on the CPU with TRITON_INTERPRET=1 set before Triton is "
           "imported (TRITON_INTERPRET=1 python -m pytest -n 0 tests/test_flex_router.py; the triton extra)")


def _unit(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1).float()


CASES = [  # B, H, N, D, k, probes, bias, padding
    (1, 2, 100, 8, 5, 1, False, False),  # D and k below a block; N not a multiple of one
    (2, 2, 130, 16, 40, 2, True, True),  # two chunks of clusters, two probes
    (1, 3, 64, 32, 33, 3, True, False),
]


@kernels
@pytest.mark.parametrize("B, H, N, D, k, probes, bias, padding", CASES)
def test_the_kernels_route_as_pytorch( B: int, H: int, N: int, D: int, k: int, probes: int, bias: bool,
                                      padding: bool) -> None:
    """float32 against float64 PyTorch: every pick within rounding of the best score at its rank (a near tie may
    fall the other way), the picks distinct; the best cluster's cosine; the counts, the stable sort by (cluster,
    position) and its inverse of the kernel's own picks exactly; the statistics of the real positions within
    rounding."""
    device = DEVICE
    r = _unit(B, H, N, D, seed=1)
    centroids = _unit(H, k, D, seed=2)
    b = torch.randn(H, k, generator=torch.Generator().manual_seed(3)) * 0.05 if bias else None
    valid = rand_padding(B, N, seed=4) if padding else None
    got = flex_router.launch(r.to(device), centroids.to(device), None if b is None else b.to(device),
                             None if valid is None else valid.to(device), probes, True)
    chosen, order, inverse, grouped, counts, sums, weights, cosine = (x.cpu() for x in got)
    scores = torch.einsum("bhnd,hkd->bhnk", r.double(), centroids.double())
    biased = scores + (0 if b is None else b.double()[:, None, :])
    best = biased.sort(-1, descending=True).values[..., :probes]
    picked = biased.gather(-1, chosen)
    assert chosen.dtype == torch.long and chosen.shape == (B, H, N, probes)
    assert (picked - best).abs().max() < 1e-5  # each rank's pick scores the rank's best, up to float32 rounding
    assert all(chosen[..., s].ne(chosen[..., t]).all() for s in range(probes) for t in range(s))
    torch.testing.assert_close(cosine.double(), scores.gather(-1, chosen[..., :1])[..., 0], rtol=0, atol=1e-5)
    keys = chosen[..., 0]
    torch.testing.assert_close(counts, F.one_hot(keys, k).sum(2))
    want = sort_by_cluster(keys)
    assert torch.equal(order, want.order) and torch.equal(inverse, want.inverse) and torch.equal(grouped, want.grouped)
    weight = torch.ones(B, N) if valid is None else valid.double()
    flat = (torch.arange(H)[None, :, None] * k + keys).reshape(-1)
    w = weight[:, None, :].expand(B, H, N).reshape(-1).double()
    want_sums = torch.zeros(H * k, D, dtype=torch.float64).index_add_(0, flat, r.double().reshape(-1, D) * w[:, None])
    want_weights = torch.zeros(H * k, dtype=torch.float64).index_add_(0, flat, w)
    torch.testing.assert_close(sums.double(), want_sums.view(H, k, D), rtol=0, atol=1e-4)
    torch.testing.assert_close(weights.double(), want_weights.view(H, k), rtol=0, atol=0)


@kernels
def test_the_same_bits_at_every_launch_and_nothing_without_observe() -> None:
    device = DEVICE
    r, centroids = _unit(2, 2, 150, 16, seed=5).to(device), _unit(2, 20, 16, seed=6).to(device)
    valid = rand_padding(2, 150, seed=7).to(device)
    first, second = (flex_router.launch(r, centroids, None, valid, 2, True) for _ in range(2))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    quiet = flex_router.launch(r, centroids, None, valid, 2, False)
    assert quiet[5].numel() == 0 and quiet[6].numel() == 0
    for a, b in zip(first[:5], quiet[:5], strict=True):
        assert torch.equal(a, b)


def _stub_flex(q, k, v, *, block_mask, scale, score_mod=None):
    """FlexAttention's call as one differentiable stand-in of its shapes (on the GPU: one compiled kernel)."""
    return q * scale + v.mean(2, keepdim=True), q.float().sum(-1)


def _routing_step(N: int, monkeypatch) -> object:
    """One training forward and backward of a causal routing layer with the paper's rule (k = sqrt(N) clusters,
    window N / k, shared QK, 8 heads of 64) on the flex executor, on the ``meta`` device, bfloat16 as on a GPU."""
    monkeypatch.setattr(flex_ops, "flex_call", _stub_flex)
    k = round(math.sqrt(N))
    layer = RoutingAttention(8, 64, RoutingOptions(num_clusters=k, window=N // k, probes=1, balance=0.0))
    layer = layer.to("meta").train()
    layer.executor = get_executor("flex")
    q = torch.empty(1, 8, N, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty(1, 8, N, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # the second step is counted: the first also makes what the sizes alone decide, once
        with OperatorCount() as count:
            out = layer(q, q, v)
            (out.float().sum() + layer.commitment_loss).backward()
    return count


def test_a_routing_step_takes_as_many_operators_at_any_length(monkeypatch) -> None:
    """The paper's rule on the flex executor at 65,536 and 262,144 positions: the same operators, at most 150 (the
    router one custom operator, the block tables a fixed number), none writing the (B, H, N, k) scores."""
    if not hasattr(torch.ops.routeformer_flex, "route"):
        pytest.skip("the flex router's operator is not registered")
    small, large = _routing_step(65536, monkeypatch), _routing_step(262144, monkeypatch)
    assert small.ops == large.ops
    assert large.ops["route"] == 1
    assert sum(large.ops.values()) <= 150, large.ops
    assert large.largest < 8 * 262144 * 512  # B · H · N · k at k = 512


@kernels
@pytest.mark.parametrize("probes, balance", [(1, 0.0), (2, 0.01)])
def test_a_routing_layer_trains_the_same_on_the_kernels(probes: int, balance: float) -> None:
    """Two training steps of a causal routing layer on the flex executor (float32, padding), routed by the kernels
    and by PyTorch's operators: the same output, gradients, commitment loss and state after each update (the
    centroids' seeding included)."""
    import dataclasses

    from routeformer.executors.routes import Routed

    B, H, N, D = 2, 2, 40, 8
    options = RoutingOptions(num_clusters=5, window=6, probes=probes, balance=balance)
    layers = [RoutingAttention(H, D, options).train().to(DEVICE) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    flex = get_executor("flex")
    kernel_route = dataclasses.replace(flex, route_run=lambda *a: Routed(*flex_router.launch(
        a[0].contiguous(), a[1].float().contiguous(), None if a[2] is None else a[2].float().contiguous(),
        None if a[3] is None else a[3].contiguous(), a[4], a[5])))
    layers[0].executor, layers[1].executor = kernel_route, dataclasses.replace(flex, route_run=None)
    g = torch.Generator().manual_seed(11)
    q, v = (torch.randn(B, H, N, D, generator=g).to(DEVICE) for _ in range(2))
    pad = rand_padding(B, N, seed=12).to(DEVICE)
    results = []
    for layer in layers:
        steps = []
        for _ in range(2):
            x = [t.clone().requires_grad_() for t in (q, v)]
            out = layer(x[0], x[0], x[1], key_padding_mask=pad)
            (out.square().sum() + layer.routing.commitment_loss).backward()
            steps.append((out.detach(), [t.grad for t in x], layer.routing.commitment_loss.detach()))
            layer.update()
            steps.append({name: b.clone() for name, b in layer.named_buffers()})
        results.append(steps)
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        step = f"step {i // 2}"  # each message names the step and the value (a GPU run's log is all one reads)
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for name in a:
                torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5,
                                           msg=lambda m, name=name, step=step: f"{step}, {name} after the update: {m}")
        else:
            torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, step=step: f"{step}, output: {m}")
            for what, x, y in zip(("q", "v"), a[1], b[1], strict=True):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, what=what, step=step: f"{step}, gradient at {what}: {m}")
            torch.testing.assert_close(a[2], b[2], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, step=step: f"{step}, commitment: {m}")


@kernels
@pytest.mark.parametrize("N, block, top, score", [(100, 7, 3, "mean"), (130, 4, 2, "bound"), (64, 16, 5, "mean"),
                                                  (50, 60, 2, "bound")])  # 5 > some rows' candidates; no block
def test_the_selection_kernel_picks_as_pytorch(N: int, block: int, top: int, score: str) -> None:
    """MoBA's block selection (``flex/selection.py``) in float32 against ``select_blocks`` over ``block_scores`` in
    float64: at every rank a pick scoring that rank's best (within rounding), -1 exactly where the query has fewer
    complete earlier blocks, the picks distinct; no (N, N / block) scores written (the kernel's output is the
    picks)."""
    from routeformer.attention.blocks import NONE, block_bounds, block_means, block_scores, select_blocks
    from routeformer.executors.flex import selection

    B, H, D = 2, 2, 8
    g = torch.Generator().manual_seed(N)
    q, k = (torch.randn(B, H, N, D, generator=g) for _ in range(2))
    nb = N // block
    keys = k[:, :, : nb * block].view(B, H, nb, block, D)
    if score == "bound":
        lo, hi = keys.amin(3), keys.amax(3)
        scoring, summary = torch.cat([q.clamp(min=0), q], -1), torch.cat([hi - lo, lo], -1)
    else:
        scoring, summary = q, keys.mean(3)
    got = selection.launch(scoring.contiguous().to(DEVICE), summary.contiguous().to(DEVICE), block, top).cpu()
    summaries = block_means(k.double(), block) if score == "mean" else block_bounds(k.double(), block)
    scores = block_scores(q.double(), (summaries,) if score == "mean" else summaries, score)
    want = select_blocks(scores, block, top)
    assert got.shape == want.shape == (B, H, N, top) and got.dtype == torch.long
    assert torch.equal(got == NONE, want == NONE)
    if nb == 0:  # no complete block: nothing to pick
        return
    real = want != NONE
    picked = scores.gather(-1, got.clamp_min(0))
    best = scores.gather(-1, want.clamp_min(0))
    assert ((picked - best).abs() < 1e-5)[real].all()
    assert (got[real] < (torch.arange(N) // block)[None, None, :, None].expand_as(got)[real]).all()
    assert all(((got[..., s] != got[..., t]) | (got[..., s] == NONE)).all() for s in range(top) for t in range(s))


@kernels
def test_a_moba_model_selects_the_same_on_the_kernel() -> None:
    """MoBA heads on the flex executor with the kernel as its ``select_run`` and with PyTorch's selection: the same
    output and gradients (float32)."""
    import dataclasses

    from routeformer.attention.moba import MobaHeads, MobaOptions
    from routeformer.executors.flex import selection

    def kernel_select(q, k, block, top, bound):  # the executor's select_run, launched on any device
        B, H, N, D = k.shape
        nb = N // block
        keys = k[:, :, : nb * block].float().view(B, H, nb, block, D)
        if bound:
            lo, hi = keys.amin(3), keys.amax(3)
            scoring, summary = torch.cat([q.float().clamp(min=0), q.float()], -1), torch.cat([hi - lo, lo], -1)
        else:
            scoring, summary = q.float(), keys.mean(3)
        return selection.launch(scoring.contiguous(), summary.contiguous(), block, top)

    flex = get_executor("flex")
    results = []
    for select_run in (kernel_select, None):
        heads = MobaHeads(2, 8, MobaOptions(block=6, top_k=2, score="bound")).to(DEVICE)
        heads.executor = dataclasses.replace(flex, select_run=select_run)
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, 2, 60, 8, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
        out = heads(q, k, v, None)
        results.append((out.detach(), *torch.autograd.grad(out.square().sum(), [q, k, v])))
    for what, a, b in zip(("output", "gradient at q", "gradient at k", "gradient at v"), *results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")
