"""The fused CPU executor beyond what every executor's tests check (patterns, routing, LSH, ranges and the model run
on it through their parametrised backends): gradcheck, results independent of the thread count, what it keeps for the
backward, torch.compile, the calls it hands to the tiles executor, and how its kernels are built and what happens
when they cannot be."""

from __future__ import annotations

import ctypes
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from helpers import rand_padding, rand_qkv, rand_rel, routing_layer
from routeformer.attention import Inputs, LocalOptions, LSHOptions, local_attention
from routeformer.attention.lsh import lsh_attention, lsh_rotations
from routeformer.bench.measure import kept_for_backward
from routeformer.executors import get_executor
from routeformer.executors.activation import sigmoid_gelu
from routeformer.executors.fused import available
from routeformer.executors.inputs import relative
from routeformer.executors.ranges import KeyOrder, Ranges
from routeformer.executors.tiling import INDEX, Distances, KeyRestrictions, Tiling

FUSED = get_executor("fused")
REPO = Path(__file__).resolve().parents[1]


def test_the_kernels_are_built_here_on_this_torch_s_blas() -> None:
    """This machine has a compiler: the suite must exercise the kernels, not the fallback; and the kernels find the
    BLAS symbols exactly when this PyTorch build exports them (else they use ATen's matmul)."""
    assert os.environ.get("ROUTEFORMER_FUSED") != "0" and available()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    assert torch.ops.routeformer_fused.has_blas() == (hasattr(lib, "sgemm_") and hasattr(lib, "dgemm_"))


@pytest.mark.parametrize("causal", [True, False])
def test_a_local_window_reaches_the_kernel_by_name(causal: bool, monkeypatch) -> None:
    """local_attention's window reaches the band operator as the geometry's window and causal flag alone (no
    offsets beside them: the kernel derives them), and the operator refuses a geometry that gives both."""
    from routeformer.executors.fused import executor as fused_executor
    from routeformer.executors.fused.geometry import BandGeometry

    seen = []
    apply = fused_executor.BandFunction.apply
    monkeypatch.setattr(fused_executor.BandFunction, "apply", lambda *a: seen.append(a) or apply(*a))
    q, k, v = rand_qkv(1, 2, 40, 4, grad=False)
    local_attention(Inputs.of(q, k, v), LocalOptions(7), "fused", causal=causal)
    geometry = BandGeometry(*seen[0][3])
    assert (geometry.window, geometry.causal, geometry.has_offsets) == (7, causal, False)
    both = dataclasses.replace(geometry, has_offsets=True, off_lo=-6, off_hi=0 if causal else 6)
    with pytest.raises(RuntimeError, match=r"geometry gives a window \(7\) and offsets \(-6, "):
        apply(*seen[0][:3], both.ints(), *seen[0][4:])


# --- gradcheck: float64, every value the kernel reads ---------------------------------------------------------


def _gradcheck_cases():
    g = torch.Generator().manual_seed(0)
    N = 11
    order = torch.randperm(N, generator=g).expand(1, 2, N).contiguous()
    groups = torch.randint(0, 3, (1, 2, N), generator=g)
    labels = torch.randint(0, 30, (1, 2, 2, N), generator=g)
    valid = rand_padding(1, N, seed=3)[:, None, :]
    valid[..., -1] = True
    rel = rand_rel(3, 2)
    bias = torch.randn(1, 2, 1, N, N, dtype=torch.float64, generator=g)
    band = Tiling.band(4, N, True)
    return {
        "band": dict(tiling=band),
        "band, relative, unit": dict(tiling=band, rel_pos=rel, distances=Distances(unit=1)),
        "dense, bias, delta": dict(tiling=Tiling.dense(N), bias=bias, rel_pos=rel,
                                   distances=Distances(delta=torch.randint(-3, 4, (1, 1, 1, N, N), generator=g))),
        "order, groups, own key, positions": dict(
            tiling=Tiling(block=3, back=1, offsets=(-3, 0), order=order), rel_pos=rel,
            restrict=KeyRestrictions(groups=groups.sort(-1).values, exclude_self=True),
            distances=Distances(positions=order)),
        "order, positions far apart (per-pair relative terms)": dict(
            tiling=Tiling(block=3, back=1, offsets=(-3, 0), order=order), rel_pos=rand_rel(3, 40),
            distances=Distances(positions=order * 7)),
        "labels (lowered to a tile mask), validity, unsorted groups": dict(
            tiling=Tiling(block=4, back=1, ahead=1, tile_mask=torch.rand(1, 2, 3, 4, 12, generator=g) > 0.3),
            key_valid=valid, restrict=KeyRestrictions(groups=groups, labels=labels, label_window=4)),
    }


@pytest.mark.parametrize("case", sorted(_gradcheck_cases()))
def test_gradcheck_of_the_tiled_operation(case: str) -> None:
    kw = _gradcheck_cases()[case]
    q, k, v = rand_qkv(1, 2, 11, 3, seed=4)
    tables = [kw["rel_pos"].key, kw["rel_pos"].value] if "rel_pos" in kw else []

    def f(q, k, v, *tables):
        rest = dict(kw)
        rel = relative(rest.pop("rel_pos", None), rest.pop("distances", INDEX))
        inputs = Inputs(q, k, v, 0.7, rest.pop("key_valid", None))
        out, lse = FUSED.tiled(inputs, rest.pop("tiling"), rel=rel, need_lse=True, **rest)
        return out, lse.where(lse > -1e300, 0.0)  # the lse of a row without keys is a constant

    assert torch.autograd.gradcheck(f, (q, k, v, *tables))


def test_gradcheck_of_ranges() -> None:
    g = torch.Generator().manual_seed(1)
    N, Nq, merge, width = 13, 7, 2, 4
    q, _, _ = rand_qkv(1, 2, Nq, 3, seed=2)
    _, k, v = rand_qkv(1, 2, N, 3, seed=3)
    hi = torch.randint(0, N + 1, (1, 2, Nq * merge), generator=g)
    lo = (hi - torch.randint(0, width + 1, hi.shape, generator=g)).clamp_min(0)
    lo[..., 1::2], hi[..., 1::2] = lo[..., 1::2].clamp_max(0), hi[..., 1::2].clamp_max(0)  # disjoint: 2nd empty
    order = torch.randperm(N, generator=g).expand(1, 2, N).contiguous()
    rel = rand_rel(3, 3)
    pos = torch.arange(N).expand(1, 2, N)

    def f(q, k, v, a, b):
        spans = Ranges(lo, hi, width, merge, query_pos=pos[..., :Nq], key_pos=pos)
        out, lse = FUSED.ranges(Inputs(q, k, v, 0.6), spans, order=KeyOrder(order, order.argsort(-1)), rel_pos=rel,
                                need_lse=True)
        return out, lse.where(lse > -1e300, 0.0)

    assert torch.autograd.gradcheck(f, (q, k, v, rel.key, rel.value))


# --- the same bits at one and two threads ---------------------------------------------------------------------


def _thread_cases():
    B, H, N, D = 2, 3, 300, 16
    q, k, v = rand_qkv(B, H, N, D, dtype=torch.float32, seed=5)
    rel = rand_rel(D, 40, dtype=torch.float32)
    layer = routing_layer(H, D, 6, 20, probes=2, balance=0.01)
    return (q, k, v), {
        "local+rel": lambda q, k, v: local_attention(Inputs.of(q, k, v), LocalOptions(50), "fused", rel=rel),
        "routing, two probes": lambda q, k, v: layer(q, q, v),
        "lsh": lambda q, k, v: lsh_attention(Inputs.of(q, q, v), LSHOptions(buckets=8, rounds=2, window=30), "fused",
                                             rotations=lsh_rotations(H, D, 8, 2)),
    }, rel


@pytest.mark.parametrize("name", ["local+rel", "routing, two probes", "lsh"])
def test_results_are_the_same_bits_at_one_and_two_threads(name: str) -> None:
    """Forward and gradients: every head's key gradients are summed by one thread in a fixed order (no atomics)."""
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            (q, k, v), cases, rel = _thread_cases()
            out = cases[name](q, k, v)
            leaves = [q, k, v] + ([rel.key, rel.value] if name == "local+rel" else [])
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out).cumsum(-1).sin(), allow_unused=True)
            results.append([out.detach(), *[g for g in grads if g is not None]])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


# --- memory, compile, hand-offs -------------------------------------------------------------------------------


def test_a_local_call_keeps_o_of_n_d_for_its_backward() -> None:
    """q, k, v, out and the lse: about 4× the bytes of q, whatever the window (the tiles executor keeps each tile's
    probabilities: O(N · window))."""
    q, k, v = rand_qkv(1, 4, 2048, 32, dtype=torch.float32)
    bytes_q = q.numel() * 4
    fused = kept_for_backward(lambda: local_attention(Inputs.of(q, k, v), LocalOptions(256), "fused"))
    tiles = kept_for_backward(lambda: local_attention(Inputs.of(q, k, v), LocalOptions(256), "tiles"))
    assert fused <= 5 * bytes_q < tiles


def test_compiles_into_one_graph_forward_and_backward() -> None:
    q, k, v = rand_qkv(1, 2, 40, 8, dtype=torch.float32, seed=2)
    rel = rand_rel(8, 6, dtype=torch.float32)

    def f(q, k, v):
        return local_attention(Inputs.of(q, k, v), LocalOptions(7), "fused", rel=rel)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out, ref = compiled(q, k, v), f(q, k, v)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), q)[0], torch.autograd.grad(ref.sum(), q)[0],
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_go_to_the_tiles_executor(dtype: torch.dtype) -> None:
    q, k, v = (x.to(dtype) for x in rand_qkv(1, 2, 30, 8, grad=False))
    order = torch.randperm(30).expand(1, 2, 30)
    tiling = Tiling(block=5, back=1, offsets=(-5, 0), order=order)
    out, _ = FUSED.tiled(Inputs(q, k, v, 0.3), tiling)
    ref, _ = get_executor("tiles").tiled(Inputs(q, k, v, 0.3), tiling)
    assert out.dtype == dtype and torch.equal(out, ref)


# --- autograd -------------------------------------------------------------------------------------------------


def _double_backward_cases():
    q, k, v = rand_qkv(1, 2, 40, 8, seed=6)
    order = torch.randperm(40).expand(1, 2, 40).contiguous()
    hi = torch.arange(1, 41).expand(1, 2, 40).contiguous()
    return (q, k, v), {
        "band": lambda q, k, v: local_attention(Inputs.of(q, k, v), LocalOptions(5), "fused"),
        "ranges": lambda q, k, v: FUSED.ranges(Inputs(q, k, v, 0.3), Ranges((hi - 6).clamp_min(0), hi, 6, 1),
                                               order=KeyOrder(order, order.argsort(-1)))[0],
        "LSH rounds": lambda q, k, v: lsh_attention(Inputs.of(q, q, v), LSHOptions(buckets=4, rounds=2, window=6),
                                                    "fused", rotations=lsh_rotations(2, 8, 4, 2)),
        "sigmoid GELU": lambda q, k, v: sigmoid_gelu(q, FUSED),
    }


@pytest.mark.parametrize("name", ["band", "ranges", "LSH rounds", "sigmoid GELU"])
def test_double_backward_is_an_error_naming_the_kernel(name: str) -> None:
    """create_graph=True: the first gradients are right (as without it), and differentiating them again raises,
    also when only the inputs (not the incoming gradient) require grad; before, the second-order terms dropped."""
    (q, k, v), cases = _double_backward_cases()
    out = cases[name](q, k, v)
    plain = torch.autograd.grad(out.sum(), q, retain_graph=True)[0]
    first = torch.autograd.grad(out.sum(), q, create_graph=True)[0]  # the incoming gradient needs no grad
    assert torch.equal(first.detach(), plain) and first.requires_grad
    with pytest.raises(RuntimeError, match=f"fused CPU kernel's {name} backward is not differentiable"):
        first.pow(2).sum().backward()


class _MaskRecorder:
    """Stands in for torch.ops.routeformer_fused: records each backward's output_mask and its gradients' sizes."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[bool], list[int]]] = []

    def __getattr__(self, name: str):
        op = getattr(torch.ops.routeformer_fused, name)
        if not name.endswith("_backward"):
            return op

        def recorded(*args):
            result = op(*args)
            self.seen.append((list(args[-1]), [t.numel() for t in result[:3]]))
            return result

        return recorded


@pytest.mark.parametrize("wanted", ["q", "k", "v", "qv"])
@pytest.mark.parametrize("name", ["band", "ranges", "LSH rounds"])
def test_only_the_gradients_autograd_asks_for_are_computed(name: str, wanted: str, monkeypatch) -> None:
    """The backward operators get autograd's needs_input_grad as their output_mask and leave the other gradients
    empty (their products skipped); what is computed is the same bits as with every gradient."""
    from routeformer.executors.fused import op as fused_op

    if name == "LSH rounds" and wanted == "k":
        pytest.skip("LSH's keys are made from q inside the kernel: no k")
    (q, k, v), cases = _double_backward_cases()
    grad = torch.randn(1, 2, 40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    full = torch.autograd.grad(cases[name](q, k, v), (q, k, v), grad, allow_unused=True)
    recorder = _MaskRecorder()
    monkeypatch.setattr(fused_op, "ops", lambda: recorder)
    inputs = [x.detach().requires_grad_(n in wanted) for n, x in zip("qkv", (q, k, v), strict=True)]
    asked = [x for x in inputs if x.requires_grad]
    some = torch.autograd.grad(cases[name](*inputs), asked, grad)
    mask = [n in wanted for n in "qkv"]
    assert recorder.seen and all(m == mask for m, _ in recorder.seen)
    for m, sizes in recorder.seen:
        assert [size > 0 for size in sizes[:3]][::2] == [m[0], m[2]]  # dq, dv: computed exactly when asked
        if name != "LSH rounds":
            assert (sizes[1] > 0) == m[1]
    for got, n in zip(some, [n for n in "qkv" if n in wanted], strict=True):
        assert torch.equal(got, full["qkv".index(n)])
