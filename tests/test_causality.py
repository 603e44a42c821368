"""Leak tests: with causal=True, changing q, k, v after position t changes no output at or before t.

Plus the padding contract: keys masked out by key_padding_mask do not matter, and rows that see no key are zero.
"""

from __future__ import annotations

import pytest
import torch

from helpers import PATTERN_CASES, leaks, pattern_call, rand_padding, rand_qkv, rand_rel
from routeformer.attention import PATTERNS, Inputs, LocalOptions, local_attention


@pytest.mark.parametrize("name, params", PATTERN_CASES)
@pytest.mark.parametrize("extras, backend", [("plain", "tiles"), ("relative", "tiles"), ("padding", "tiles"),
                                             ("relative", "flex"), ("padding", "flex"), ("plain", "fused"),
                                             ("relative", "fused"), ("padding", "fused")])
def test_no_leak_from_the_future(name: str, params: dict, extras: str, backend: str) -> None:
    q, k, v = rand_qkv(2, 4, 45, 8, grad=False)
    kw: dict = {}
    if extras == "relative":
        kw["rel_pos"] = rand_rel(8, 6)
    if extras == "padding":
        kw["key_padding_mask"] = rand_padding(2, 45)
    attend = pattern_call(PATTERNS[name], backend, causal=True, **params)
    for t in [0, 4, 17, 31, 43]:
        assert not leaks(lambda q, k, v: attend(q, k, v, **kw), q, k, v, t), f"future leaks into position {t}"


def test_leak_check_detects_a_leak() -> None:
    """The check above can fail: non-causal attention sees the future and must be flagged."""
    q, k, v = rand_qkv(1, 2, 30, 8, grad=False)
    assert leaks(lambda q, k, v: local_attention(Inputs.of(q, k, v), LocalOptions(4), causal=False), q, k, v, 10)



@pytest.mark.parametrize("name, params", PATTERN_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_padded_keys_do_not_matter(name: str, params: dict, causal: bool) -> None:
    q, k, v = rand_qkv(2, 4, 45, 8, grad=False)
    padding = rand_padding(2, 45)
    k2, v2 = k.clone(), v.clone()
    k2[~padding[:, None, :, None].expand_as(k)] = 1e3
    v2[~padding[:, None, :, None].expand_as(v)] = -1e3
    attend = pattern_call(PATTERNS[name], causal=causal, **params)
    a = attend(q, k, v, key_padding_mask=padding)
    b = attend(q, k2, v2, key_padding_mask=padding)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name, params", PATTERN_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_without_keys_are_zero_and_gradients_finite(name: str, params: dict, dtype) -> None:
    q, k, v = rand_qkv(2, 4, 45, 8, dtype=dtype)
    padding = torch.ones(2, 45, dtype=torch.bool)
    padding[0] = False  # the first sequence has no key at all
    out = PATTERNS[name].run(Inputs.of(q, k, v, key_padding_mask=padding), causal=True, **params)
    assert torch.all(out[0] == 0)
    assert torch.isfinite(out).all()
    out.float().square().sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
