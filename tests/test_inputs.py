"""Bad input: every function raises a ValueError naming the argument and the value, never broadcasts silently."""

from __future__ import annotations

import pytest
import torch

from helpers import rand_qkv
from routeformer.attention import (
    RelativePositions,
    fixed_attention,
    full_attention,
    local_attention,
    longformer_attention,
    strided_attention,
)

CALLS = {
    "full": lambda q, k, v, **kw: full_attention(q, k, v, **kw),
    "local": lambda q, k, v, **kw: local_attention(q, k, v, 4, **kw),
    "strided": lambda q, k, v, **kw: strided_attention(q, k, v, 4, **kw),
    "fixed": lambda q, k, v, **kw: fixed_attention(q, k, v, 4, 2, **kw),
    "longformer": lambda q, k, v, **kw: longformer_attention(q, k, v, 4, **kw),
}


@pytest.fixture
def qkv():
    return rand_qkv(2, 4, 10, 8, dtype=torch.float32, grad=False)


@pytest.mark.parametrize("name", CALLS)
def test_shape_rank_dtype_and_mask_errors(name: str, qkv) -> None:
    q, k, v = qkv
    call = CALLS[name]
    cases = [
        ((q[0], k[0], v[0]), {}, "q must have shape"),
        ((q, k[:, :, :9], v), {}, "same shape"),
        ((q, k, v[..., :4]), {}, "same shape"),
        ((q, k.double(), v), {}, "same dtype"),
        ((q, k, v.long()), {}, "floating-point"),
        ((q, k, v), {"key_padding_mask": torch.ones(2, 9, dtype=torch.bool)}, "key_padding_mask must have shape"),
        ((q, k, v), {"key_padding_mask": torch.ones(2, 10)}, "key_padding_mask must be a bool"),
        ((q, k, v), {"scale": 0.0}, "scale"),
        ((q, k, v), {"scale": float("nan")}, "scale"),
        ((q, k, v), {"rel_pos": RelativePositions(7, 3)}, "head_dim"),
        ((q, k, v), {"rel_pos": "relative"}, "rel_pos"),
    ]
    for args, kwargs, fragment in cases:
        with pytest.raises(ValueError, match=fragment):
            call(*args, **kwargs)


@pytest.mark.parametrize("call, fragment", [
    (lambda q, k, v: local_attention(q, k, v, 0), "window must be a positive integer, got 0"),
    (lambda q, k, v: local_attention(q, k, v, 2.5), "window must be a positive integer, got 2.5"),
    (lambda q, k, v: local_attention(q, k, v, True), "window"),
    (lambda q, k, v: strided_attention(q, k, v, -3), "stride must be a positive integer, got -3"),
    (lambda q, k, v: strided_attention(q[:, :3], k[:, :3], v[:, :3], 2, merged=False), "even number of heads"),
    (lambda q, k, v: fixed_attention(q, k, v, 0, 1), "block must be a positive integer, got 0"),
    (lambda q, k, v: fixed_attention(q, k, v, 4, 0), "summary must be a positive integer, got 0"),
    (lambda q, k, v: fixed_attention(q, k, v, 4, 5), "summary must be at most block"),
    (lambda q, k, v: longformer_attention(q, k, v, 3, global_tokens=[2, 10]), r"global_tokens .* \[10\]"),
    (lambda q, k, v: longformer_attention(q, k, v, 3, global_tokens=[-1]), "global_tokens"),
    (lambda q, k, v: longformer_attention(q, k, v, 3, global_tokens=[1.5]), "global_tokens"),
    (lambda q, k, v: longformer_attention(q, k, v, 3, dilation=[1, 2]), "one value per head"),
    (lambda q, k, v: longformer_attention(q, k, v, 3, dilation=[1, 2, 0, 1]), r"dilation\[2\]"),
])
def test_parameter_errors_name_argument_and_value(call, fragment: str, qkv) -> None:
    with pytest.raises(ValueError, match=fragment):
        call(*qkv)


def test_global_tokens_accept_a_tensor(qkv) -> None:
    q, k, v = qkv
    a = longformer_attention(q, k, v, 3, global_tokens=torch.tensor([1, 7]))
    b = longformer_attention(q, k, v, 3, global_tokens=[7, 1])
    torch.testing.assert_close(a, b, rtol=0, atol=0)
