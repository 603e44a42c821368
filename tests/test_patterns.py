"""Every fast path equals reference_attention fed with its pattern's mask: forward and gradients, float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import compare_with_reference, pattern_call, rand_padding, rand_qkv, rand_rel
from routeformer.attention import PATTERNS, Inputs, full_attention, full_mask, reference_attention


@st.composite
def problems(draw, name: str) -> dict:
    N = draw(st.integers(1, 70))
    params: dict = {}
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    if name == "local":
        params["window"] = draw(st.integers(1, N + 4))
    elif name == "strided":
        params["stride"] = draw(st.integers(1, N + 3))
        params["merged"] = draw(st.booleans())
    elif name == "fixed":
        params["block"] = draw(st.integers(1, N + 3))
        params["summary"] = draw(st.integers(1, params["block"]))
        params["merged"] = draw(st.booleans())
    elif name == "longformer":
        params["window"] = draw(st.integers(1, 9))
        params["dilation"] = draw(st.one_of(st.integers(1, 5), st.lists(st.integers(1, 5), min_size=heads,
                                                                          max_size=heads)))
        params["global_tokens"] = draw(st.lists(st.integers(0, N - 1), max_size=3, unique=True))
    if params.get("merged") is False and heads % 2:
        heads += 1
    return {
        "B": draw(st.integers(1, 2)), "H": heads, "N": N, "D": draw(st.integers(1, 12)),
        "causal": draw(st.booleans()), "params": params,
        "rel": draw(st.one_of(st.none(), st.integers(1, N + 2))),
        "padding": draw(st.booleans()), "seed": draw(st.integers(0, 2**16)),
    }


def _run(name: str, p: dict, backend: str = "tiles") -> None:
    pattern = PATTERNS[name]
    q, k, v = rand_qkv(p["B"], p["H"], p["N"], p["D"], seed=p["seed"])
    rel = None if p["rel"] is None else rand_rel(p["D"], p["rel"], seed=p["seed"])
    padding = rand_padding(p["B"], p["N"], seed=p["seed"]) if p["padding"] else None
    mask = pattern.build_mask(p["N"], p["H"], p["causal"], **p["params"])

    compare_with_reference(pattern_call(pattern, backend, causal=p["causal"], **p["params"]), mask, q, k, v,
                           key_padding_mask=padding, rel_pos=rel)


@pytest.mark.parametrize("name", sorted(PATTERNS))
@given(data=st.data())
def test_matches_reference(name: str, data) -> None:
    _run(name, data.draw(problems(name)))


# FlexAttention's uncompiled CPU path takes 7-12 s a worker for these (2026-12-07): CI's slow line runs them; the
# documents tests run every pattern on flex in the default suite
FLEX_SLOW = {"fixed", "longformer", "strided"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in FLEX_SLOW else n
                                  for n in sorted(PATTERNS)])
@settings(max_examples=5)
@given(data=st.data())
def test_flex_matches_reference(name: str, data) -> None:
    """The flex executor (FlexAttention's eager operator on CPU) on the same random problems, fewer of them."""
    _run(name, data.draw(problems(name)), backend="flex")


@pytest.mark.parametrize("name", sorted(PATTERNS))
@given(data=st.data())
def test_fused_matches_reference(name: str, data) -> None:
    """The fused CPU kernels on the same random problems."""
    _run(name, data.draw(problems(name)), backend="fused")


@pytest.mark.parametrize(
    "name, params",
    [
        ("full", {}),
        ("local", {"window": 16}),
        ("local", {"window": 40}),
        ("strided", {"stride": 8, "merged": True}),
        ("strided", {"stride": 8, "merged": False}),
        ("fixed", {"block": 16, "summary": 4, "merged": True}),
        ("fixed", {"block": 16, "summary": 4, "merged": False}),
        ("longformer", {"window": 8, "dilation": [1, 2, 3, 1], "global_tokens": [0, 50]}),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rel, backend", [(None, "tiles"), (24, "tiles"), (24, "flex"), (None, "fused"),
                                          (24, "fused")])
def test_multi_block_cases(name: str, params: dict, causal: bool, rel, backend: str) -> None:
    """Longer sequences than the property test draws: many blocks, a ragged last block, clipped distances."""
    _run(name, {"B": 2, "H": 4, "N": 131, "D": 8, "causal": causal, "params": params, "rel": rel,
                "padding": True, "seed": 7}, backend)


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item()


@pytest.mark.parametrize("name, params", [
    ("full", {}), ("local", {"window": 24}), ("strided", {"stride": 9, "merged": True}),
    ("strided", {"stride": 9, "merged": False}), ("fixed", {"block": 16, "summary": 4, "merged": True}),
    ("longformer", {"window": 8, "dilation": [1, 2, 1, 2], "global_tokens": [3]}),
])
@pytest.mark.parametrize("causal", [True, False])
def test_bfloat16_error_within_twice_the_reference_rounding(name: str, params: dict, causal: bool) -> None:
    """In bf16 the fast path's error against float64 is at most twice the bf16 reference's own error."""
    pattern = PATTERNS[name]
    q, k, v = rand_qkv(2, 4, 97, 32, seed=3, grad=False)
    mask = pattern.build_mask(97, 4, causal, **params)
    exact = reference_attention(Inputs.of(q, k, v), mask)
    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    ref16 = reference_attention(Inputs.of(q16, k16, v16), mask)
    fast16 = pattern.run(Inputs.of(q16, k16, v16), causal=causal, **params)
    assert fast16.dtype == torch.bfloat16
    assert _max_err(fast16, exact) <= 2 * _max_err(ref16, exact)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_float16_error_within_twice_the_reference_rounding(name: str) -> None:
    """float16 with padding (rows with no key included): finite, and its error against float64 is at most twice the
    float16 reference's own error."""
    pattern = PATTERNS[name]
    params = {"full": {}, "local": {"window": 8}, "strided": {"stride": 5}, "fixed": {"block": 8, "summary": 2},
              "longformer": {"window": 4, "global_tokens": [0]}}[name]
    q, k, v = rand_qkv(1, 2, 40, 16, grad=False)
    padding = rand_padding(1, 40)
    mask = pattern.build_mask(40, 2, True, **params)
    exact = reference_attention(Inputs.of(q, k, v, key_padding_mask=padding), mask)
    q16, k16, v16 = (x.half() for x in (q, k, v))
    ref16 = reference_attention(Inputs.of(q16, k16, v16, key_padding_mask=padding), mask)
    out = pattern.run(Inputs.of(q16, k16, v16, key_padding_mask=padding), causal=True, **params)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert _max_err(out, exact) <= 2 * _max_err(ref16, exact)


@pytest.mark.parametrize("causal", [True, False])
def test_float16_relative_full_attention_keeps_rows_without_keys_zero(causal: bool) -> None:
    """Clipped relative positions split full attention into a band and far keys; a row that sees no key must stay
    exactly zero in float16 too (the far keys' a^V term must not be added to it), the rest as accurate as the
    float16 reference."""
    N, D = 12, 8
    q, k, v = rand_qkv(2, 2, N, D, grad=False)
    rel, rel16 = rand_rel(D, 2), rand_rel(D, 2, dtype=torch.float16)  # max_distance 2 < N - 1
    padding = torch.ones(2, N, dtype=torch.bool)
    padding[:, :4] = False  # a leading padded span: causal rows 0-3 see no key
    padding[1] = False  # a sequence without any key
    mask = full_mask(N, causal, heads=2)
    exact = reference_attention(Inputs.of(q, k, v, key_padding_mask=padding), mask, rel=rel)
    q16, k16, v16 = (x.half() for x in (q, k, v))
    ref16 = reference_attention(Inputs.of(q16, k16, v16, key_padding_mask=padding), mask, rel=rel16)
    out = full_attention(Inputs.of(q16, k16, v16, key_padding_mask=padding), causal=causal, rel=rel16)
    no_key = ~(mask & padding[:, None, None, :]).any(-1)  # (B, H, N)
    assert no_key.any() and (~no_key).any()
    assert out.dtype == torch.float16 and torch.all(out[no_key] == 0)
    assert _max_err(out, exact) <= 2 * _max_err(ref16, exact)


@pytest.mark.parametrize("name, params", [
    ("full", {}), ("local", {"window": 5}), ("local", {"window": 200}), ("strided", {"stride": 4}),
    ("strided", {"stride": 4, "merged": False}), ("fixed", {"block": 8, "summary": 2}),
    ("fixed", {"block": 8, "summary": 2, "merged": False}),
    ("longformer", {"window": 3, "dilation": [1, 2, 1, 2], "global_tokens": [1]}),
])
@pytest.mark.parametrize("causal", [True, False])
def test_non_contiguous_inputs(name: str, params: dict, causal: bool) -> None:
    """Models hand over q, k, v as x.view(B, N, H, D).transpose(1, 2): strided views, not contiguous tensors."""
    pattern = PATTERNS[name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, 4, 8, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    rel = rand_rel(8, 6)
    got = pattern.run(Inputs.of(q, k, v), causal=causal, rel=rel, **params)
    want = pattern.run(Inputs.of(q.contiguous(), k.contiguous(), v.contiguous()), causal=causal, rel=rel, **params)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    mask = pattern.build_mask(37, 4, causal, **params)
    torch.testing.assert_close(got, reference_attention(Inputs.of(q, k, v), mask, rel=rel))
