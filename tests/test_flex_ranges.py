"""The flex executor's own ``ranges`` (multi-probe routing on CUDA): its block mask holds exactly the key blocks the
ranges touch, nothing around the FlexAttention call grows as N², and nothing reads the device from the host. (Its
results against the dense definition, forward and gradients, are in test_ranges; routing layers on flex in
test_routing, test_causality and test_model.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import rand_padding, rand_qkv, rand_rel
from routeformer.executors import Inputs, get_executor
from routeformer.executors.flex import ranges as flex_ranges
from routeformer.executors.lse import neg_inf
from routeformer.executors.ranges import KeyOrder, Ranges
from routeformer.testing import host_reads


def _spans(B: int, H: int, N: int, Nq: int, merge: int, width: int, seed: int) -> tuple[Ranges, KeyOrder]:
    """Random disjoint ranges (entry t of a row in the t-th part of the keys), some empty, over a random key
    order; query and key positions 0..N-1 and random query rows."""
    g = torch.Generator().manual_seed(seed)
    part = N // merge
    t = torch.arange(Nq * merge) % merge
    hi = t * part + torch.randint(0, part + 1, (B, H, Nq * merge), generator=g)
    lo = torch.maximum(hi - torch.randint(0, width + 1, (B, H, Nq * merge), generator=g), t * part)
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)
    pos = torch.randint(0, N, (B, H, Nq), generator=g)
    return (Ranges(lo, hi, width, merge, query_pos=pos, key_pos=torch.arange(N).expand(B, H, N)),
            KeyOrder(order, order.argsort(-1)))


@pytest.mark.parametrize("block", [8, 16])
def test_block_mask_holds_exactly_the_key_blocks_the_ranges_touch(block: int) -> None:
    B, H, M, N = 2, 3, 203, 150
    g = torch.Generator().manual_seed(block)
    first = torch.randint(0, N + 1, (B, H, M), generator=g).sort(-1).values
    last = (first + torch.randint(0, 20, (B, H, M), generator=g)).clamp_max(N)
    last[0, 0, :40] = first[0, 0, :40]  # empty ranges, a whole block of rows with none
    mask = flex_ranges.range_block_mask(first, last, N, lambda b, h, i, j: i >= 0, block)
    got = mask.to_dense().bool()
    assert mask.full_kv_num_blocks is None or not mask.full_kv_num_blocks.any()
    # the definition: row block r touches key block c if one of its rows' ranges holds a key of c
    keys = torch.arange(N)
    holds = (keys >= first[..., None]) & (keys < last[..., None])  # (B, H, M, N)
    nqb, nkb = -(-M // block), -(-N // block)
    padded = torch.nn.functional.pad(holds, (0, nkb * block - N, 0, nqb * block - M))
    want = padded.view(B, H, nqb, block, nkb, block).any(-1).any(-2)
    assert torch.equal(got, want)
    assert not want[0, 0, :40 // block].any() and want.any()


class _Largest(TorchDispatchMode):
    """Records the largest tensor any operator returns (host reads: ``routeformer.testing.host_reads``)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def _stub_call(q, k, v, *, block_mask, scale, score_mod=None):
    """FlexAttention's call replaced by a differentiable stand-in of its shapes (the compiled kernel on CUDA keeps
    O(N · D); on the CPU its eager operator is dense, which is not what is measured here)."""
    out = q * 0.5 + v.mean(2, keepdim=True)
    lse = q.float().sum(-1) * scale
    return out, lse


@pytest.mark.parametrize("relative", [False, True])
def test_routing_ranges_around_the_kernel_stay_linear_in_n_and_read_nothing_on_the_host(monkeypatch,
                                                                                         relative: bool) -> None:
    """N = 4096, two probes of width 32, relative positions with padding: forward and backward allocate no tensor
    near N² (the largest is O(N · merge · (width + 2k + 1))) and call no operator that reads a value on the host."""
    monkeypatch.setattr(flex_ranges, "flex_call", _stub_call)
    monkeypatch.setattr(flex_ranges, "CHUNK", 1 << 18)
    B, H, N, D, merge, width = 1, 2, 4096, 16, 2, 32
    q, k, v = rand_qkv(B, H, N, D, dtype=torch.float32)
    spans, order = _spans(B, H, N, N, merge, width, seed=0)
    rel = rand_rel(D, 8, dtype=torch.float32) if relative else None
    valid = rand_padding(B, N)[:, None, :] if relative else None
    with host_reads() as reads, _Largest() as watch:
        out, lse = get_executor("flex").ranges(Inputs(q, k, v, D**-0.5, valid), spans, order=order, rel_pos=rel,
                                               need_lse=True)
        (out.sum() + lse.where(lse > neg_inf(lse.dtype) / 2, 0.0).sum()).backward()
    assert not reads.found, f"host reads in flex ranges:\n{reads.report()}"
    linear = B * H * N * merge * max(D, width + (2 * 8 + 1 if relative else 0))
    assert watch.largest <= 4 * linear < N * N, f"largest tensor {watch.largest} elements for N = {N}"
