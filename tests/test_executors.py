"""The executor registry: patterns compute through the executor their ``backend`` names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import rand_qkv
from routeformer import TransformerConfig
from routeformer.attention import RoutingAttention, fixed_attention, local_attention, longformer_attention
from routeformer.attention.executors import (
    EXECUTORS,
    OPERATIONS,
    get_executor,
    register_executor,
    resolve_backend,
)


def test_auto_is_flex_on_cuda_and_tiles_elsewhere_and_unknown_names_are_listed() -> None:
    assert resolve_backend("auto", "cuda") == "flex" and resolve_backend("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_backend("auto", "cpu") == "tiles" and resolve_backend("auto", None) == "tiles"
    assert resolve_backend("flex", "cpu") == "flex" and resolve_backend("tiles", "cuda") == "tiles"
    assert get_executor() is EXECUTORS["tiles"] and get_executor("flex", "cpu") is EXECUTORS["flex"]
    with pytest.raises(ValueError, match=r"^unknown attention backend 'fused'; known: auto, tiles, flex$"):
        get_executor("fused")
    q, k, v = rand_qkv(1, 1, 8, 4, grad=False)
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        local_attention(q, k, v, 3, backend="cuda")
    with pytest.raises(ValueError, match="unknown attention backend"):
        RoutingAttention(1, 4, 2, 3, backend="triton")


def test_register_refuses_duplicates_and_incomplete_executors() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_executor("tiles", get_executor())
    with pytest.raises(ValueError, match="lacks the operations band"):
        register_executor("partial", dataclasses.replace(get_executor(), band=None))
    assert "partial" not in EXECUTORS


def test_patterns_call_the_executor_their_backend_names() -> None:
    """A registered executor named as the backend receives the patterns' calls (here: the tiled ones, counted),
    the block diagonal and key subsets included, through its own ``tiled``."""
    tiles = get_executor("tiles")
    calls: list[str] = []

    def counted(op: str):
        def run(*args, **kwargs):
            calls.append(op)
            return getattr(tiles, op)(*args, **kwargs)
        return run

    spy = dataclasses.replace(tiles, name="spy", **{op: counted(op) for op in OPERATIONS})
    q, k, v = rand_qkv(1, 2, 40, 8, grad=False)
    routing = RoutingAttention(2, 8, 3, 6).double()
    want = [local_attention(q, k, v, 5), fixed_attention(q, k, v, 8, 2), longformer_attention(q, k, v, 4, 1, [0]),
            routing(q, q, v)]
    register_executor("spy", spy)
    try:
        routing.backend = "spy"
        got = [local_attention(q, k, v, 5, backend="spy"), fixed_attention(q, k, v, 8, 2, backend="spy"),
               longformer_attention(q, k, v, 4, 1, [0], backend="spy"), routing(q, q, v)]
    finally:
        del EXECUTORS["spy"]
    assert set(calls) == set(OPERATIONS)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_the_config_backend_reaches_every_executor_head_and_is_checked() -> None:
    from routeformer import TransformerLM

    config = TransformerConfig(dim=32, heads=4, depth=1, seq_len=32, window=4, num_clusters=2,
                               attention="local:1,routing:1,lsh:2", backend="flex", positions="none")
    groups = TransformerLM(config).blocks[0].attention.groups
    # resolved once into the executor itself
    assert [g.backend for g in groups[:2]] == [EXECUTORS["flex"]] * 2 and groups[1].routing.backend is EXECUTORS["flex"]
    assert groups[2].backend == "auto"  # LSH computes its own way: the setting is not its to take
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        TransformerConfig(dim=32, heads=4, seq_len=32, window=4, backend="fast")
    with pytest.raises(ValueError, match="backend='flex' would change nothing"):
        TransformerConfig(dim=32, heads=4, seq_len=32, attention="linear", kernel="elu", positions="none",
                          backend="flex")


def test_kernels_without_a_fused_path_refuse_the_flex_backend() -> None:
    q, k, v = rand_qkv(1, 1, 8, 4, grad=False)
    with pytest.raises(ValueError, match="backend='flex' has no path for kernel='poly2'"):
        local_attention(q, k, v, 3, kernel="poly2", backend="flex")
    local_attention(q, k, v, 3, kernel="poly2", backend="tiles")  # the one implementation
