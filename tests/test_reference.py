"""The reference itself: agrees with SDPA, with the paper's equations written as loops, and with its own contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import rand_qkv, rand_rel
from routeformer.attention import Inputs, full_mask, local_mask, reference_attention


def test_matches_sdpa_causal_and_not() -> None:
    q, k, v = rand_qkv(2, 3, 19, 5, grad=False)
    for causal in (True, False):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(reference_attention(Inputs.of(q, k, v), full_mask(19, causal)), want)


def test_relative_positions_follow_the_two_equations() -> None:
    """e_ij = q_i·(k_j + a^K_ij)/sqrt(D), z_i = Σ_j α_ij (v_j + a^V_ij), a_ij = w[clip(j - i, k)], by loops."""
    N, D, clip = 7, 3, 2
    q, k, v = rand_qkv(1, 1, N, D, grad=False)
    rel = rand_rel(D, clip)
    mask = local_mask(N, 4, causal=False)
    got = reference_attention(Inputs.of(q, k, v), mask, rel=rel)
    wk, wv = rel.key.detach(), rel.value.detach()
    for i in range(N):
        e = {}
        for j in range(N):
            if mask[i, j]:
                d = max(-clip, min(clip, j - i)) + clip
                e[j] = float(q[0, 0, i] @ (k[0, 0, j] + wk[d])) / math.sqrt(D)
        top = max(e.values())
        total = sum(math.exp(x - top) for x in e.values())
        z = sum(math.exp(e[j] - top) / total * (v[0, 0, j] + wv[max(-clip, min(clip, j - i)) + clip]) for j in e)
        torch.testing.assert_close(got[0, 0, i], z)


def test_mask_shapes_broadcast_alike() -> None:
    q, k, v = rand_qkv(2, 3, 11, 4, grad=False)
    m = local_mask(11, 3)
    a = reference_attention(Inputs.of(q, k, v), m)
    b = reference_attention(Inputs.of(q, k, v), m.expand(3, 11, 11))
    c = reference_attention(Inputs.of(q, k, v), m.expand(2, 3, 11, 11))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_rows_without_keys_are_zero_without_nan() -> None:
    q, k, v = rand_qkv(1, 2, 6, 4)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    out = reference_attention(Inputs.of(q, k, v), mask)
    assert torch.all(out[:, :, 2] == 0)
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_runs_in_float64() -> None:
    q, k, v = rand_qkv(1, 1, 4, 2, grad=False)
    assert reference_attention(Inputs.of(q, k, v), full_mask(4)).dtype == torch.float64


@pytest.mark.parametrize("mask, fragment", [
    (torch.ones(5, 5), "bool"),
    (torch.ones(4, 4, dtype=torch.bool), "shape"),
    (torch.ones(3, 5, 5, dtype=torch.bool), "shape"),
    (torch.ones(1, 2, 5, 5, dtype=torch.bool), "shape"),
])
def test_bad_masks_are_rejected(mask, fragment: str) -> None:
    q, k, v = rand_qkv(2, 2, 5, 4, grad=False)
    with pytest.raises(ValueError, match=fragment):
        reference_attention(Inputs.of(q, k, v), mask)


def test_the_inputs_padding_is_one_row_per_batch() -> None:
    """``Inputs.of`` keeps the key padding mask as (B, 1, N): the reference reads that, equal to masking the keys
    itself; a per-head validity (an executor's value, not a user's) is refused by name."""
    q, k, v = rand_qkv(2, 2, 7, 4, grad=False)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 3:] = False
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    masked = (mask & valid[:, None, None, :]).expand(2, 2, 7, 7)
    torch.testing.assert_close(reference_attention(Inputs.of(q, k, v, key_padding_mask=valid), mask),
                               reference_attention(Inputs.of(q, k, v), masked))
    per_head = Inputs.of(q, k, v).with_(key_valid=valid[:, None, :].expand(2, 2, 7))
    with pytest.raises(ValueError, match=r"one key validity per batch row \(B, 1, N\)"):
        reference_attention(per_head, mask)
