"""The executor registry: patterns compute through the executor their ``backend`` names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import rand_qkv, rand_rel, routing_layer
from routeformer import TransformerConfig
from routeformer.attention import (
    FixedOptions,
    Inputs,
    LocalOptions,
    LongformerOptions,
    fixed_attention,
    local_attention,
    longformer_attention,
)
from routeformer.executors import (
    EXECUTORS,
    FEATURES,
    Band,
    Executor,
    describe_backend,
    get_executor,
    register_executor,
    resolve_backend,
)
from routeformer.executors.inputs import RelTerms, relative
from routeformer.executors.tiling import INDEX, Distances, KeyRestrictions, Tiling, Window


def test_auto_is_flex_on_cuda_and_fused_on_the_cpu_and_unknown_names_are_listed() -> None:
    assert resolve_backend("auto", "cuda") == "flex" and resolve_backend("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_backend("auto", "cpu") == "fused" and resolve_backend("auto", None) == "fused"
    assert resolve_backend("auto", "meta") == "tiles"
    assert resolve_backend("flex", "cpu") == "flex" and resolve_backend("tiles", "cuda") == "tiles"
    assert get_executor() is EXECUTORS["fused"] and get_executor("flex", "cpu") is EXECUTORS["flex"]
    with pytest.raises(ValueError, match=r"^unknown attention backend 'triton'; known: auto, fused, tiles, flex$"):
        get_executor("triton")
    q, k, v = rand_qkv(1, 1, 8, 4, grad=False)
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        local_attention(Inputs.of(q, k, v), LocalOptions(3), "cuda")
    with pytest.raises(ValueError, match="unknown attention backend"):
        routing_layer(1, 4, 2, 3, backend="triton")


def test_nothing_meant_for_cuda_builds_the_cpu_kernels(monkeypatch) -> None:
    """Choosing, describing and binding the executor of a CUDA model never starts the CPU kernels' build (25-60 s):
    every build and load goes through ``KERNELS.status``, made to fail here."""
    from routeformer import TransformerLM
    from routeformer.executors.fused import KERNELS
    from routeformer.train import executor_line, load_run_config

    def refuse() -> None:
        raise AssertionError("the CPU kernels were built or loaded for CUDA")

    monkeypatch.setattr(KERNELS, "status", refuse)
    cuda = torch.device("cuda", 0)
    assert resolve_backend("auto", "cuda") == "flex" and get_executor("auto", cuda) is EXECUTORS["flex"]
    assert describe_backend("auto", cuda) == "attention: flex (the default on cuda)"
    run = load_run_config(None, ["precision=float32", "attention=local:2,routing:2"])
    assert run.model.backend == "auto"
    assert executor_line(run, cuda) == "attention: flex (the default on cuda)"
    model = TransformerLM(run.model)  # built on the CPU, to be moved: "auto" waits for its device
    model._bind_executors(cuda)  # what its first forward on CUDA does
    assert {g.executor.name for b in model.blocks for g, on in zip(b.attention.groups, b.attention.on_executor,
                                                                    strict=True) if on} == {"flex"}
    with pytest.raises(AssertionError, match="built or loaded for CUDA"):  # the CPU's "auto" does build
        resolve_backend("auto", "cpu")


def test_register_refuses_duplicates_and_incomplete_executors() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_executor("tiles", get_executor())
    with pytest.raises(ValueError, match="must be an Executor with a callable run"):
        register_executor("partial", dataclasses.replace(get_executor("tiles"), run=None))
    with pytest.raises(ValueError, match="must be an Executor, got object"):
        register_executor("partial", object())
    with pytest.raises(ValueError, match=r"names unknown features \['gather'\]"):
        register_executor("partial", Executor("partial", get_executor("tiles").run, frozenset({"rows", "gather"})))
    assert "partial" not in EXECUTORS


def test_patterns_call_the_executor_their_backend_names() -> None:
    """A registered executor named as the backend receives the patterns' calls (here: the tiled ones, counted),
    the block diagonal and key subsets included, through its own ``tiled``."""
    tiles = get_executor("tiles")
    calls: list[str] = []

    def counted(*args, **kwargs):
        calls.append("tiled")
        return tiles.run(*args, **kwargs)

    spy = Executor("spy", counted)
    q, k, v = rand_qkv(1, 2, 40, 8, grad=False)
    routing = routing_layer(2, 8, 3, 6).double()
    routing.executor = get_executor("tiles")
    x = Inputs.of(q, k, v)
    want = [local_attention(x, LocalOptions(5), "tiles"), fixed_attention(x, FixedOptions(8, 2), "tiles"),
            longformer_attention(x, LongformerOptions(4, 1, [0]), "tiles"), routing(q, q, v)]
    register_executor("spy", spy)
    try:
        routing.executor = spy
        got = [local_attention(x, LocalOptions(5), "spy"), fixed_attention(x, FixedOptions(8, 2), "spy"),
               longformer_attention(x, LongformerOptions(4, 1, [0]), "spy"), routing(q, q, v)]
    finally:
        del EXECUTORS["spy"]
    assert len(calls) >= 4
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_the_config_backend_reaches_every_executor_head_and_is_checked() -> None:
    from routeformer import TransformerLM

    config = TransformerConfig(dim=32, heads=4, depth=1, seq_len=32, rel_clip=4,
                               options={"local": {"window": 4}, "routing": {"num_clusters": 2}},
                               attention="local:1,routing:1,lsh:2", backend="flex", positions="none")
    groups = TransformerLM(config).blocks[0].attention.groups
    # resolved once into the executor itself; LSH's rounds run on it too
    assert [g.executor for g in groups] == [EXECUTORS["flex"]] * 3
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        TransformerConfig(dim=32, heads=4, seq_len=32, options={"local": {"window": 4}}, rel_clip=4, backend="fast")
    with pytest.raises(ValueError, match="backend='flex' would change nothing"):
        TransformerConfig(dim=32, heads=4, seq_len=32, attention="linear", options={"linear": {"kernel": "poly2"}},
                          positions="none", backend="flex")  # elu's heads run on the executor's scan: not poly2's


def test_the_activation_goes_through_the_models_executor(monkeypatch) -> None:
    """The feed-forward's x · sigmoid(1.702 x) runs on the model's executor like its attention: with
    ``backend="tiles"`` a forward and backward call no kernel of ours; with ``"fused"`` the activation's kernel
    runs, and the two models' logits and gradients agree to rounding."""
    from routeformer import TransformerLM
    from routeformer.executors.fused import available
    from routeformer.executors.fused import op as fused_op

    called: list[str] = []
    ops = fused_op.ops

    class Recording:
        def __getattr__(self, name):
            called.append(name)
            return getattr(ops(), name)

    monkeypatch.setattr(fused_op, "ops", Recording)
    config = TransformerConfig(vocab_size=32, dim=32, heads=2, depth=1, seq_len=32, attention="local",
                               options={"local": {"window": 4}}, backend="tiles")
    results = []
    for backend in ("tiles", "fused") if available() else ("tiles",):
        torch.manual_seed(0)
        model = TransformerLM(dataclasses.replace(config, backend=backend)).double()
        with torch.no_grad():
            model.head.weight.normal_()
        del called[:]
        logits = model(torch.arange(32)[None])
        logits.square().sum().backward()
        results.append((logits, model.blocks[0].ff.w1.weight.grad, list(called)))
    assert results[0][2] == []
    if len(results) > 1:
        assert "sigmoid_gelu" in results[1][2] and "sigmoid_gelu_backward" in results[1][2]
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-12, atol=1e-12)


def test_kernels_without_a_fused_path_refuse_the_flex_backend() -> None:
    q, k, v = rand_qkv(1, 1, 8, 4, grad=False)
    with pytest.raises(ValueError, match="executor='flex' has no path for kernel='poly2'"):
        local_attention(Inputs.of(q, k, v), LocalOptions(3, kernel="poly2"), "flex")
    local_attention(Inputs.of(q, k, v), LocalOptions(3, kernel="poly2"), "tiles")  # the one implementation


def _dense_reference(q, k, v, tiling: Tiling, bias, scale):
    """softmax(q·kᵀ·scale + bias, masked) · v from the dense (N, N) pairs: the tiling's span and static mask and
    the bias, both placed by plain index arithmetic (span column s of query block b is key (b - back)·block + s)."""
    N = q.shape[2]
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    b, r = i // tiling.block, i % tiling.block
    s = j - (b - tiling.back) * tiling.block
    inside = (s >= 0) & (s < tiling.span)
    allow = inside & tiling.allow[r, s.clamp(0, tiling.span - 1)]
    dense_bias = bias[:, :, b, r, s.clamp(0, tiling.span - 1)]  # (B, H, N, N)
    scores = (q @ k.transpose(-1, -2)) * scale + dense_bias
    scores = scores.masked_fill(~allow, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("backend", ["tiles", "flex", "fused"])
def test_an_additive_bias_matches_the_dense_definition(backend: str) -> None:
    """The additive per-pair term (e.g. -log count) on a banded tiling, forward and gradients, in float64."""
    q, k, v = rand_qkv(2, 3, 37, 8)
    allow = torch.rand(8, 16, generator=torch.Generator().manual_seed(3)) < 0.7
    own = torch.eye(8, 16, dtype=torch.bool).roll(8, 1)  # span column r + back·block: no row without a key
    tiling = Tiling(block=8, back=1, allow=allow | own)
    bias = torch.randn(2, 3, 5, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out, _ = get_executor(backend).tiled(Inputs(q, k, v, 0.3), tiling, bias=bias)
    ref = _dense_reference(q, k, v, tiling, bias, 0.3)
    assert (out - ref).abs().max() < 1e-12
    weights = torch.randn_like(ref)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g - r).abs().max() < 1e-12


def test_the_values_refuse_what_does_not_fit_with_errors_that_name_it() -> None:
    q, k, v = rand_qkv(1, 2, 16, 4, grad=False)
    tiles = get_executor("tiles")
    with pytest.raises(ValueError, match="exactly one of unit, delta and positions, got none"):
        Distances()
    with pytest.raises(ValueError, match="exactly one of unit, delta and positions, got unit, delta"):
        Distances(unit=1, delta=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="Distances.delta must be an integer tensor"):
        Distances(delta=torch.zeros(3))
    with pytest.raises(ValueError, match="allow or offsets, not both"):
        Tiling(block=4, allow=torch.ones(4, 4, dtype=torch.bool), offsets=(-1, 0))
    with pytest.raises(ValueError, match=r"Tiling.block must be an integer >= 1, got 0"):
        Tiling(block=0)
    with pytest.raises(ValueError, match=r"Tiling.offsets \(-2, 0\) are not those of its window "
                                         r"Window\(window=4, causal=True\) \(\(-3, 0\)\)"):
        Tiling(block=4, offsets=(-2, 0), window=Window(4, causal=True))
    with pytest.raises(ValueError, match=r"Window.window must be an integer >= 1, got 0"):
        Window(0, causal=False)
    assert Tiling(block=4, window=Window(3, causal=False)).offsets == (-2, 2)  # the window's, derived
    assert Tiling.band(8, 64, causal=True).window == Window(8, causal=True)  # the name kept on the way down
    with pytest.raises(ValueError, match=r"tile mask must have shape \(4, 8\), got \(4, 4\)"):
        tiles.tiled(Inputs(q, k, v, 1.0), Tiling(block=4, back=1, allow=torch.ones(4, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match="banded tiles need as many keys as queries"):
        tiles.tiled(Inputs(q, k[:, :, :8], v[:, :, :8], 1.0), Tiling(block=4, back=1))
    with pytest.raises(ValueError, match="the caller gives the tile mask"):
        tiles.tiled(Inputs(q[:, :, :8], k, v, 1.0), Tiling(block=8, rows=4))
    with pytest.raises(ValueError, match="with rows, queries are not at key positions"):
        tiles.tiled(Inputs(q[:, :, :8], k, v, 1.0),
                    Tiling(block=8, rows=4, tile_mask=torch.ones(4, 8, dtype=torch.bool)),
                    restrict=KeyRestrictions(exclude_self=True))
    assert relative(rand_rel(4, 3)).distances == INDEX  # relative terms always carry their distances (by index)
    with pytest.raises(TypeError):
        RelTerms(rand_rel(4, 3))  # ... given: the value has no default (dynamo < 2.13 cannot wrap one)
    with pytest.raises(ValueError, match="bias takes no gradient"):
        tiles.tiled(Inputs(q, k, v, 1.0), Tiling.dense(16), bias=torch.zeros(16, 16, dtype=q.dtype,
                                                                             requires_grad=True))


def test_an_executor_refuses_what_it_does_not_support_and_names_who_does() -> None:
    q, k, v = rand_qkv(1, 2, 16, 4, grad=False)
    bias = torch.zeros(1, 1, 1, 16, 16, dtype=q.dtype)
    no_rel_bias = Executor("no-rel-bias", get_executor("tiles").run,
                           frozenset(FEATURES) - {"order", "labels", "bias with relative positions"})
    with pytest.raises(ValueError, match=r"the 'no-rel-bias' executor does not support bias with relative positions; "
                                         r"'fused', 'tiles' and 'flex' do"):
        no_rel_bias.tiled(Inputs(q, k, v, 1.0), Tiling.dense(16), bias=bias, rel=relative(rand_rel(4, 3)))
    with pytest.raises(ValueError, match=r"does not support bias, bias with exclude_self; 'fused', 'tiles' and 'flex' "
                                         r"do"):
        Executor("partial", get_executor("flex").run, frozenset({"exclude_self"})).tiled(
            Inputs(q, k, v, 1.0), Tiling.dense(16), bias=bias, restrict=KeyRestrictions(exclude_self=True))
    plain = Executor("plain", get_executor("tiles").run, frozenset({"tile_mask"}))
    with pytest.raises(ValueError, match="the 'plain' executor does not support groups, exclude_self; 'fused', "
                                         "'tiles' and 'flex' do"):
        plain.tiled(Inputs(q, k, v, 1.0), Band(3, causal=True),
                    restrict=KeyRestrictions(groups=torch.zeros(1, 2, 16, dtype=torch.long), exclude_self=True))
    out, _ = plain.tiled(Inputs(q, k, v, 1.0), Band(3, causal=True))  # what it supports runs
    assert torch.equal(out, local_attention(Inputs.of(q, k, v, scale=1.0), LocalOptions(3), "tiles"))


def test_a_row_left_empty_by_the_range_of_the_last_block_is_zero_with_lse_neg_inf() -> None:
    """Blocks without neighbours under a static mask: a row of the last, partial block whose only allowed column is
    beyond the keys sees nothing (the host-read shortcut must see that too)."""
    from routeformer.attention import reference_attention
    from routeformer.executors import neg_inf

    q, k, v = rand_qkv(1, 2, 7, 4, grad=False)
    allow = torch.ones(4, 4, dtype=torch.bool)
    allow[2] = False
    allow[2, 3] = True  # row 2 sees column 3 only: key 4·b + 3, beyond the keys in the last block (keys 4..6)
    out, lse = get_executor("tiles").tiled(Inputs(q, k, v, 0.5), Tiling(block=4, allow=allow), need_lse=True)
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    dense = (i // 4 == j // 4) & allow[i % 4, j % 4]
    assert not dense[6].any() and dense[2].any()
    ref = reference_attention(Inputs.of(q, k, v, scale=0.5), dense)
    assert torch.equal(out[:, :, 6], torch.zeros_like(out[:, :, 6])) and (lse[:, :, 6] == neg_inf(lse.dtype)).all()
    assert (out - ref).abs().max() < 1e-12
