"""The executor registry: patterns compute through the default executor, chosen by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import rand_qkv
from routeformer.attention import RoutingAttention, fixed_attention, local_attention, longformer_attention
from routeformer.attention.executors import (
    EXECUTORS,
    OPERATIONS,
    get_executor,
    register_executor,
    set_default_executor,
)


def test_the_tiled_executor_is_the_default_and_unknown_names_are_listed() -> None:
    assert get_executor() is get_executor("tiled") is EXECUTORS["tiled"]
    with pytest.raises(ValueError, match=r"^unknown attention executor 'fused'; known: tiled$"):
        get_executor("fused")
    with pytest.raises(ValueError, match="unknown attention executor"):
        set_default_executor("fused")


def test_register_refuses_duplicates_and_incomplete_executors() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_executor("tiled", get_executor())
    with pytest.raises(ValueError, match="lacks the operations subset"):
        register_executor("partial", dataclasses.replace(get_executor(), subset=None))
    assert "partial" not in EXECUTORS


def test_patterns_call_the_default_executor() -> None:
    """A registered executor made the default receives the patterns' calls (here: the tiled ones, counted)."""
    tiled = get_executor("tiled")
    calls: list[str] = []

    def counted(op: str):
        def run(*args, **kwargs):
            calls.append(op)
            return getattr(tiled, op)(*args, **kwargs)
        return run

    spy = dataclasses.replace(tiled, name="spy", **{op: counted(op) for op in OPERATIONS})
    q, k, v = rand_qkv(1, 2, 40, 8, grad=False)
    routing = RoutingAttention(2, 8, 3, 6).double()
    want = [local_attention(q, k, v, 5), fixed_attention(q, k, v, 8, 2), longformer_attention(q, k, v, 4, 1, [0]),
            routing(q, q, v)]
    register_executor("spy", spy)
    previous = set_default_executor("spy")
    try:
        got = [local_attention(q, k, v, 5), fixed_attention(q, k, v, 8, 2), longformer_attention(q, k, v, 4, 1, [0]),
               routing(q, q, v)]
    finally:
        set_default_executor(previous)
        del EXECUTORS["spy"]
    assert previous == "tiled" and get_executor() is tiled
    assert set(calls) == set(OPERATIONS)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
