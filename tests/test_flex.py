"""The flex executor: its block masks hold exactly the blocks its rules allow, and on CUDA the compiled kernels
agree with the tiled executor. (Its results against the dense reference, its leak tests and decoding run in
test_patterns, test_routing, test_causality and test_model, parametrised by backend.)"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import _ordered_to_dense

from helpers import compare_with_reference, rand_padding, rand_qkv, rand_rel, routing_layer
from routeformer.attention import PATTERNS
from routeformer.executors import flex
from routeformer.executors.flex import blocks

BLOCK = (16, 8)


def _recorded(monkeypatch) -> list:
    """Every (pattern, block mask) the flex operations build, with small blocks so that sequences of ~100 span
    many of them."""
    seen = []

    def small(pattern, batch, heads, device, block=BLOCK):
        mask = blocks._build(pattern, batch if pattern.per_head else 1, heads if pattern.per_head else 1, device,
                             BLOCK)
        seen.append((pattern, mask, batch, heads))
        return mask

    monkeypatch.setattr(flex.ops, "block_mask", small)
    return seen


def _dense_blocks(pattern, B: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(some, every) (B, H, nqb, nkb): blocks with an allowed pair / with only allowed pairs (in range), from the
    rule evaluated on every pair."""
    bq, bk = BLOCK
    nqb, nkb = -(-pattern.nq // bq), -(-pattern.nk // bk)
    i = torch.arange(nqb * bq).view(1, 1, -1, 1)
    j = torch.arange(nkb * bk).view(1, 1, 1, -1)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    real = (i < pattern.nq) & (j < pattern.nk)
    allowed = pattern.allowed(b, h, i, j) & real
    grid = allowed.expand(B, H, -1, -1).reshape(B, H, nqb, bq, nkb, bk)
    some = grid.any(-1).any(-2)
    every = (grid | ~real.reshape(1, 1, nqb, bq, nkb, bk)).all(-1).all(-2) & some
    return some, every


PATTERN_CASES = [
    ("local", {"window": 1}), ("local", {"window": 13}), ("local", {"window": 40}),
    ("strided", {"stride": 6, "merged": True}), ("fixed", {"block": 12, "summary": 3, "merged": True}),
    ("longformer", {"window": 5, "dilation": [1, 3], "global_tokens": [0, 50]}), ("full", {}),
]


@pytest.mark.parametrize("name, params", PATTERN_CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padding", [False, True])
def test_block_masks_hold_exactly_the_blocks_with_allowed_pairs(monkeypatch, name, params, causal, padding) -> None:
    """On CPU FlexAttention's eager path reads only ``mask_mod``, so a block wrongly left out would go unseen by
    the comparisons with the reference: the block structure is checked here against the rule itself."""
    seen = _recorded(monkeypatch)
    q, k, v = rand_qkv(2, 2, 101, 8, grad=False)
    PATTERNS[name].attend(q, k, v, causal=causal, **params, rel_pos=rand_rel(8, 9),
                          key_padding_mask=rand_padding(2, 101) if padding else None, backend="flex")
    _check(seen)


@pytest.mark.parametrize("causal", [True, False])
def test_routing_block_masks_are_per_head_and_exact(monkeypatch, causal: bool) -> None:
    seen = _recorded(monkeypatch)
    layer = routing_layer(3, 8, 4, 7, causal=causal, balanced=False, backend="flex").double()
    q, _, v = rand_qkv(2, 3, 97, 8, grad=False)
    layer(q, q, v, rel_pos=rand_rel(8, 5))
    assert all(p.per_head for p, *_ in seen)
    _check(seen)


def _check(seen: list) -> None:
    assert seen, "the flex executor built no block mask"
    for pattern, mask, B, H in seen:
        b, h = (B, H) if pattern.per_head else (1, 1)
        some, every = _dense_blocks(pattern, b, h)
        listed = mask.to_dense().bool()
        full = _ordered_to_dense(mask.full_kv_num_blocks, mask.full_kv_indices,
                                 mask.full_kv_indices.shape[-1]).bool()
        assert listed.shape == full.shape == some.shape
        assert torch.equal(listed, some), pattern.cache_key
        assert torch.equal(full, every), pattern.cache_key


@pytest.mark.parametrize("causal", [True, False])
def test_relative_values_when_every_key_of_a_piece_is_beyond_the_clip(causal: bool) -> None:
    """Strided columns with the clip nearer than the second grid row: the value pass enumerates no near key of
    that piece, and all its mass belongs to the clipped rows a^V(±k)."""
    q, k, v = rand_qkv(2, 2, 60, 8)
    rel = rand_rel(8, 4)
    mask = PATTERNS["strided"].build_mask(60, 2, causal, stride=7)
    compare_with_reference(lambda *x, **kw: PATTERNS["strided"].attend(*x, stride=7, causal=causal, backend="flex",
                                                                       **kw),
                           mask, q, k, v, key_padding_mask=rand_padding(2, 60), rel_pos=rel)


def test_static_block_masks_are_cached_and_data_masks_are_not(monkeypatch) -> None:
    built = []
    real = blocks._build
    monkeypatch.setattr(blocks, "_build", lambda *a: built.append(a[0].cache_key) or real(*a))
    blocks._CACHE.clear()
    q, k, v = rand_qkv(1, 2, 70, 8, grad=False)
    for _ in range(2):
        PATTERNS["local"].attend(q, k, v, window=9, backend="flex")
    assert len(built) == 1 and built[0] is not None  # built once, under a key
    for _ in range(2):
        PATTERNS["local"].attend(q, k, v, window=9, key_padding_mask=rand_padding(1, 70), backend="flex")
    assert built[1:] == [None, None]


def cuda(test):
    """Compiled FlexAttention: CUDA only, and marked ``cuda`` (the device tests ``pytest -m cuda`` and
    scripts/device_check.py run)."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="needs CUDA (compiled FlexAttention)")(test))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, params", [("local", {"window": 256}), ("strided", {"stride": 64}),
                                          ("fixed", {"block": 128, "summary": 8}),
                                          ("longformer", {"window": 64, "global_tokens": [0, 700]})])
@pytest.mark.parametrize("rel", [False, True])
def test_cuda_flex_kernels_agree_with_tiles(name: str, params: dict, dtype, rel: bool) -> None:
    """The compiled kernels against the tiled executor, forward and gradients, at a size with many blocks."""
    q, k, v = (x.detach().to("cuda", dtype).requires_grad_() for x in rand_qkv(1, 4, 2048, 64, torch.float32))
    rel_pos = rand_rel(64, 32, dtype=torch.float32).cuda() if rel else None
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    outs = []
    for backend in ("tiles", "flex"):
        out = PATTERNS[name].attend(q, k, v, causal=True, rel_pos=rel_pos, **params, backend=backend)
        grads = torch.autograd.grad(out.float().square().sum(), [q, k, v])
        outs.append((out, *grads))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b.float(), a.float(), **tol)


@cuda
def test_cuda_routing_runs_on_flex_by_default() -> None:
    layer = routing_layer(4, 64, 16, 128).cuda()
    assert layer.executor.name == "flex"
    q, _, v = (x.detach().cuda().float() for x in rand_qkv(1, 4, 4096, 64, torch.float32))
    want = routing_layer(4, 64, 16, 128, backend="tiles").cuda()
    want.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer.eval()(q, q, v), want.eval()(q, q, v), atol=1e-4, rtol=1e-4)
