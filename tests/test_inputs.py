"""Bad input: every function raises a ValueError naming the argument and the value, never broadcasts silently."""

from __future__ import annotations

import pytest
import torch

from helpers import rand_qkv
from routeformer.attention import (
    FixedOptions,
    Inputs,
    LocalOptions,
    LongformerOptions,
    RelativePositions,
    StridedOptions,
    fixed_attention,
    full_attention,
    local_attention,
    longformer_attention,
    strided_attention,
)

# each pattern's call: its inputs made by Inputs.of (what a user writes), its options, the relative tables
CALLS = {
    "full": lambda inputs, rel: full_attention(inputs, rel=rel),
    "local": lambda inputs, rel: local_attention(inputs, LocalOptions(4), rel=rel),
    "strided": lambda inputs, rel: strided_attention(inputs, StridedOptions(4), rel=rel),
    "fixed": lambda inputs, rel: fixed_attention(inputs, FixedOptions(4, 2), rel=rel),
    "longformer": lambda inputs, rel: longformer_attention(inputs, LongformerOptions(4), rel=rel),
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
        ((q, k, v), {"rel": RelativePositions(7, 3)}, "head_dim"),
        ((q, k, v), {"rel": "relative"}, "rel must be a RelativePositions"),
    ]
    for args, kwargs, fragment in cases:
        rel = kwargs.pop("rel", None)
        with pytest.raises(ValueError, match=fragment):
            call(Inputs.of(*args, **kwargs), rel)


@pytest.mark.parametrize("call, fragment", [
    (lambda x: local_attention(x, LocalOptions(0)), "window must be a positive integer, got 0"),
    (lambda x: local_attention(x, LocalOptions(2.5)), "window must be a positive integer, got 2.5"),
    (lambda x: local_attention(x, LocalOptions(True)), "window"),
    (lambda x: local_attention(x, 4), "options must be a LocalOptions"),
    (lambda x: local_attention(x, FixedOptions()), "options must be a LocalOptions .* got FixedOptions"),
    (lambda x: full_attention(x, "exp"), "options must be a KernelOptions"),
    (lambda x: strided_attention(x, StridedOptions(stride=-3)), "stride must be a positive integer, got -3"),
    (lambda x: strided_attention(x.head_range(0, 3), StridedOptions(stride=2), merged=False), "even number of heads"),
    (lambda x: fixed_attention(x, FixedOptions(block=0, summary=1)), "block must be a positive integer, got 0"),
    (lambda x: fixed_attention(x, FixedOptions(block=4, summary=0)), "summary must be a positive integer, got 0"),
    (lambda x: fixed_attention(x, FixedOptions(block=4, summary=5)), "summary .* must be at most block"),
    (lambda x: longformer_attention(x, LongformerOptions(window=3, global_tokens=[2, 10])), r"global_tokens .* \[10\]"),
    (lambda x: longformer_attention(x, LongformerOptions(window=3, global_tokens=[-1])), "global_tokens"),
    (lambda x: longformer_attention(x, LongformerOptions(window=3, global_tokens=[1.5])), "global_tokens"),
    (lambda x: longformer_attention(x, LongformerOptions(window=3, dilation=[1, 2])), "one value per head"),
    (lambda x: longformer_attention(x, LongformerOptions(window=3, dilation=[1, 2, 0, 1])), r"dilation\[2\]"),
])
def test_parameter_errors_name_argument_and_value(call, fragment: str, qkv) -> None:
    with pytest.raises(ValueError, match=fragment):
        call(Inputs.of(*qkv))


def test_global_tokens_accept_a_tensor(qkv) -> None:
    q, k, v = qkv
    a = longformer_attention(Inputs.of(q, k, v), LongformerOptions(window=3, global_tokens=torch.tensor([1, 7])))
    b = longformer_attention(Inputs.of(q, k, v), LongformerOptions(window=3, global_tokens=[7, 1]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
