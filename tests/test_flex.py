"""The flex executor: its block masks hold exactly the blocks its rules allow, and on CUDA the compiled kernels
agree with the tiled executor. (Its results against the dense reference, its leak tests and decoding run in
test_patterns, test_routing, test_causality and test_model, parametrised by backend.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    check_interval_tables,
    compare_with_reference,
    pattern_call,
    rand_padding,
    rand_qkv,
    rand_rel,
    routing_layer,
)
from routeformer import TransformerConfig, TransformerLM
from routeformer.attention import PATTERNS, Inputs, reference_attention
from routeformer.attention.reference import reference_scores
from routeformer.attention.routing.probes import probe_masks
from routeformer.attention.routing.sorted_window import drop_own_key
from routeformer.executors import KeyRestrictions, Tiling, flex, get_executor, neg_inf
from routeformer.executors.flex import blocks
from routeformer.executors.inputs import relative
from routeformer.executors.tiling import Distances

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
    PATTERNS[name].run(Inputs.of(q, k, v, key_padding_mask=rand_padding(2, 101) if padding else None), "flex",
                       causal=causal, rel=rand_rel(8, 9), **params)
    _check(seen)


@pytest.mark.parametrize("causal", [True, False])
def test_routing_block_masks_are_per_head_and_exact(monkeypatch, causal: bool) -> None:
    """The sorted window's block tables (one interval per query: ``flex/windows.py``, test_flex_windows) in a
    routing layer with relative positions: per head, and holding exactly the blocks of the rule."""
    seen = []
    build = blocks.interval_block_mask
    monkeypatch.setattr(blocks, "BLOCK", 16)
    monkeypatch.setattr(blocks, "interval_block_mask",
                        lambda lo, hi, reach, mask_mod, **kw: seen.append((mask_mod, build(lo, hi, reach, mask_mod,
                                                                                           **kw))) or seen[-1][1])
    layer = routing_layer(3, 8, 4, 7, causal=causal, balanced=False, backend="flex").double()
    q, _, v = rand_qkv(2, 3, 97, 8, grad=False)
    layer(q, q, v, rel_pos=rand_rel(8, 5))
    (mask_mod, mask), = seen
    assert mask.kv_indices.shape[:2] == (2, 3)
    # shared QK: the own key trimmed from a causal window's intervals; a two-sided one's rule leaves the diagonal out
    check_interval_tables(mask_mod, mask, (2, 3, 97), 16, exact=causal)


def _listed(num: torch.Tensor, idx: torch.Tensor, blocks: int) -> torch.Tensor:
    """The (…, rows, blocks) bool table of the first num[…, r] indices of each row of idx (a BlockMask's full
    blocks; FlexAttention's own helper for it is private and changed its signature between releases)."""
    first = torch.arange(idx.shape[-1]) < num[..., None]
    return torch.zeros(*idx.shape[:-1], blocks, dtype=torch.long).scatter_add_(-1, idx.long(), first.long()) > 0


def _check(seen: list) -> None:
    assert seen, "the flex executor built no block mask"
    for pattern, mask, B, H in seen:
        b, h = (B, H) if pattern.per_head else (1, 1)
        some, every = _dense_blocks(pattern, b, h)
        listed = mask.to_dense().bool()
        full = _listed(mask.full_kv_num_blocks, mask.full_kv_indices, listed.shape[-1])
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
    compare_with_reference(pattern_call(PATTERNS["strided"], "flex", causal=causal, stride=7), mask, q, k, v,
                           key_padding_mask=rand_padding(2, 60), rel_pos=rel)


def test_static_block_masks_are_cached_and_data_masks_are_not(monkeypatch) -> None:
    built = []
    real = blocks._build
    monkeypatch.setattr(blocks, "_build", lambda *a: built.append(a[0].cache_key) or real(*a))
    blocks._CACHE.clear()
    q, k, v = rand_qkv(1, 2, 70, 8, grad=False)
    for _ in range(2):
        PATTERNS["local"].run(Inputs.of(q, k, v), "flex", window=9)
    assert len(built) == 1 and built[0] is not None  # built once, under a key
    for _ in range(2):
        PATTERNS["local"].run(Inputs.of(q, k, v, key_padding_mask=rand_padding(1, 70)), "flex", window=9)
    assert built[1:] == [None, None]


def _bias_problem(frame: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(allow (n, n), bias (2, 3, n, n)) for the value pass's frames: causal (offsets, one-sided), a random
    two-sided mask (offsets, the right side's second call) and either mask read through explicit deltas (the
    "all" frame). Row 5 sees only its own key and row 7 nothing, so the own-key fallback and empty rows are hit."""
    g = torch.Generator().manual_seed(5)
    if frame == "offsets, one-sided":
        allow = torch.ones(n, n, dtype=torch.bool).tril()
    else:
        allow = torch.rand(n, n, generator=g) < 0.6
    allow[5] = torch.arange(n) == 5
    allow[7] = False
    return allow, torch.randn(2, 3, n, n, generator=g, dtype=torch.float64) * 3


@pytest.mark.parametrize("exclude_self", [False, True])
@pytest.mark.parametrize("rel, frame", [(False, "offsets, one-sided"), (True, "offsets, one-sided"),
                                        (True, "offsets, two-sided"), (True, "all")])
def test_a_bias_is_added_wherever_flex_recomputes_scores(rel: bool, frame: str, exclude_self: bool) -> None:
    """A bias with relative positions (the value pass recomputes the probabilities outside the kernel) and with the
    own-key rule (the fallback recomputes the own score): out, lse and gradients against the dense definition in
    float64, on each of the value pass's frames (clipped distances, so the clipped rows' mass is checked too;
    without relative positions there is no value pass)."""
    n, scale = 29, 0.4
    q, k, v = rand_qkv(2, 3, n, 8)
    allow, bias = _bias_problem(frame, n)
    rel_pos = rand_rel(8, 4) if rel else None
    idx = torch.arange(n)
    distances = Distances(delta=idx[None, :] - idx[:, None]) if frame == "all" else Distances(unit=1)
    out, lse = get_executor("flex").tiled(
        Inputs(q, k, v, scale), Tiling.dense(n, allow=allow), rel=relative(rel_pos, distances), bias=bias[:, :, None],
        restrict=KeyRestrictions(exclude_self=True) if exclude_self else None, need_lse=True)
    mask = drop_own_key(allow, torch.eye(n, dtype=torch.bool)) if exclude_self else allow
    ref = reference_attention(Inputs.of(q, k, v, scale=scale), mask, rel=rel_pos, bias=bias)
    scores = reference_scores(q, k, scale, rel_pos=rel_pos, bias=bias).masked_fill(~mask, float("-inf"))
    ref_lse = torch.where(mask.any(-1), scores.logsumexp(-1), neg_inf(lse.dtype))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    leaves = [q, k, v] + ([rel_pos.key, rel_pos.value] if rel else [])
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    got = torch.autograd.grad((out * weights).sum() + lse.clamp_min(-1e3).sum(), leaves)
    want = torch.autograd.grad((ref * weights).sum() + ref_lse.clamp_min(-1e3).sum(), leaves)
    for name, a, b in zip(["q", "k", "v", "a^K", "a^V"], got, want, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"gradient of {n}: {m}")


def test_routing_warms_up_and_hands_over_on_flex() -> None:
    """The warm-up and the hand-over with shared QK and relative positions (a bias with the own-key rule and the
    relative value pass, which flex once refused) on flex: equal to the dense float64 definition, forward and
    gradients of q, v and both tables, and then routed."""
    layer = routing_layer(2, 8, 4, 5, causal=True, balance=0.01, probes=2, warmup=1, handover=2,
                          backend="flex").double()
    n = 30
    q, _, v = rand_qkv(2, 2, n, 8)
    rel = rand_rel(8, 5)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = drop_own_key(causal, torch.eye(n, dtype=torch.bool))
    for step in range(3):
        assert layer.dense and layer.handing_over == (step > 0)
        bias = None
        if layer.handing_over:  # from the definition: -16 · (s + 1) / handover outside the probes' windows
            routed = probe_masks(layer.routing.route_keys(q, q), layer.routing.probe(q, q), 5).any(2)
            bias = (~routed).double() * -16.0 * step / 2
        out = layer(q, q, v, rel_pos=rel)
        want = reference_attention(Inputs.of(q, q, v), mask, rel=rel, bias=bias)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        leaves = (q, v, rel.key, rel.value)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step), dtype=out.dtype)
        for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(want, leaves, grad), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
        layer.update()
    assert not layer.dense
    torch.testing.assert_close(layer(q, q, v, rel_pos=rel), reference_attention(Inputs.of(q, q, v),
                                                                                layer.routing_mask(q, q), rel=rel))


@pytest.mark.parametrize("chunk", [1 << 24, 5000])
@pytest.mark.parametrize("causal, clip", [(True, 16), (False, 16), (False, 400)])
def test_the_value_pass_at_a_window_of_hundreds(monkeypatch, causal: bool, clip: int, chunk: int) -> None:
    """The relative value pass over the offsets of a 300-key window (its blocks, windows of keys and the band of
    their scores), in one chunk and in many: local attention against the dense float64 reference, forward and
    gradients, with the clip nearer than the window (only the near keys enumerated, the far mass from the
    log-sum-exp; two-sided: the right side's second call) and beyond it (every offset enumerated)."""
    monkeypatch.setattr(flex.score_terms, "_CHUNK", chunk)
    q, k, v = rand_qkv(1, 2, 700, 8)
    mask = PATTERNS["local"].build_mask(700, 2, causal, window=300)
    compare_with_reference(pattern_call(PATTERNS["local"], "flex", causal=causal, window=300), mask, q, k, v,
                           key_padding_mask=rand_padding(1, 700), rel_pos=rand_rel(8, clip))


def test_the_value_pass_runs_as_many_operators_at_any_window(monkeypatch) -> None:
    """The operators the value pass dispatches, forward and backward, at windows of 130 and 300 (one chunk): the
    same count (a loop per offset ran about ten per offset)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    real = flex.score_terms.value_term
    counts = []

    def counted(pattern, q, k, lse, *rest):
        with Count() as mode:  # the pass's own operators: lse (the kernel's) held constant
            out = real(pattern, q, k, lse.detach(), *rest)
            out.backward(torch.ones_like(out), inputs=[q])
        counts.append(mode.ops)
        return out.detach()

    monkeypatch.setattr(flex.ops, "value_term", counted)
    for window in (130, 300):
        q, k, v = rand_qkv(1, 2, 700, 8)
        PATTERNS["local"].run(Inputs.of(q, k, v), "flex", rel=rand_rel(8, 400), window=window)
    assert len(counts) == 2 and counts[0] == counts[1], counts


@pytest.mark.parametrize("chunk", [1 << 24, 5000])
def test_the_value_pass_reads_distances_between_positions_at_a_window_of_hundreds(monkeypatch, chunk: int) -> None:
    """The sorted window (distances between the entries' original positions, one table row per pair): routing's
    layer at a window of 200 against the reference over its mask, forward and gradients."""
    monkeypatch.setattr(flex.score_terms, "_CHUNK", chunk)
    layer = routing_layer(2, 8, 2, 200, causal=False, balanced=False, backend="flex").double()
    q, k, v = rand_qkv(1, 2, 500, 8)
    compare_with_reference(lambda *x, **kw: layer(*x, **kw), layer.routing_mask(q, k), q, k, v,
                           rel_pos=rand_rel(8, 24))



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
    """The compiled kernels against the tiled executor, forward and gradients, at a size with many blocks. In
    float32 to 1e-4. In bfloat16 both round differently (the device check found single elements 0.13 apart), so
    each is measured against the tiled executor in float64: flex's relative error (Frobenius) at most twice the
    tiled executor's own in bfloat16, or 1% when that is smaller."""
    q, k, v = (x.detach().to("cuda", dtype).requires_grad_() for x in rand_qkv(1, 4, 2048, 64, torch.float32))
    rel_pos = rand_rel(64, 32, dtype=torch.float32).cuda() if rel else None

    def run(backend: str, q, k, v, rel_pos):
        out = PATTERNS[name].run(Inputs.of(q, k, v), backend, rel=rel_pos, **params)
        return (out, *torch.autograd.grad(out.float().square().sum(), [q, k, v]))

    tiles, flex = run("tiles", q, k, v, rel_pos), run("flex", q, k, v, rel_pos)
    if dtype == torch.float32:
        for a, b in zip(tiles, flex, strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        return
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    exact = run("tiles", *wide, None if rel_pos is None else rel_pos.double())

    def error(x: torch.Tensor, ref: torch.Tensor) -> float:
        return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))

    for what, a, b, ref in zip(("out", "dq", "dk", "dv"), tiles, flex, exact, strict=True):
        assert error(b, ref) <= max(2 * error(a, ref), 1e-2), (what, error(b, ref), error(a, ref))


@cuda
def test_cuda_routing_runs_on_flex_by_default() -> None:
    layer = routing_layer(4, 64, 16, 128).cuda()
    assert layer.executor.name == "flex"
    q, _, v = (x.detach().cuda().float() for x in rand_qkv(1, 4, 4096, 64, torch.float32))
    want = routing_layer(4, 64, 16, 128, backend="tiles").cuda()
    want.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer.eval()(q, q, v), want.eval()(q, q, v), atol=1e-4, rtol=1e-4)


def _skewed(step: int, shape: tuple[int, ...], vocab: int = 32) -> torch.Tensor:
    """Random tokens whose spread changes with the step, so that clusters and buckets change size between steps."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, max(2, vocab >> (step % 4)), shape, generator=g)


RECOMPILE_CASES = {
    "local": ("local:2", {"local": {"window": 8}}, "relative", 0),
    "routing, the paper's rule": ("local:1,routing:1", {"local": {"window": 8}, "routing": {
        "num_clusters": 4, "window": 8, "probes": 1, "balance": 0.0}}, "relative", 0),
    "routing, warm-up and hand-over": ("routing:2", {"routing": {
        "num_clusters": 4, "window": 8, "probes": 2, "warmup": 1, "handover": 1}}, "relative", 2),
    "lsh": ("lsh:2", {"lsh": {"buckets": 4, "window": 8}}, "absolute", 0),
    "moba": ("moba:2", {"moba": {"block": 8, "top_k": 2}}, "relative", 0),
    "nsa": ("nsa:2", {"nsa": {"block": 8, "top": 2, "window": 8}}, "relative", 0),
}


@pytest.mark.parametrize("case", list(RECOMPILE_CASES.values()), ids=list(RECOMPILE_CASES))
@torch._dynamo.config.patch(automatic_dynamic_shapes=False)
def test_training_compiles_flex_a_bounded_number_of_times(case) -> None:
    """Shapes depend on the configuration and N only: after two steps (past the warm-up and hand-over, where there
    are some), three steps on new random data compile FlexAttention no more. Dynamo's automatic dynamic shapes
    are off, as in the CUDA path (``torch.compile(..., dynamic=False)``), so any new shape would recompile."""
    from torch._dynamo.utils import counters

    attention, options, positions, phases = case
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=32, dim=32, depth=2, heads=2, seq_len=64,
                                            attention=attention, options=options, backend="flex",
                                            positions=positions, rel_clip=8)).train()
    graphs = []
    for step in range(phases + 5):
        tokens = _skewed(step, (2, 65))
        logits = model(tokens[:, :-1])
        (F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss).backward()
        model.after_optimizer_step(step)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[phases + 1], graphs


@pytest.mark.parametrize("members", ["balanced", "sorted"])
@torch._dynamo.config.patch(automatic_dynamic_shapes=False)
def test_encoder_routing_compiles_flex_a_bounded_number_of_times(members: str) -> None:
    """The encoder's rules: the balanced clusters (how many queries are in no cluster changes with the data; their
    tiles are as many as there can be) and the non-causal sorted window, five steps on data whose clusters
    change: no compilation after the first two."""
    from torch._dynamo.utils import counters

    layer = routing_layer(2, 8, 8, 4, causal=False, balanced=members == "balanced", backend="flex")
    rel = rand_rel(8, 4, dtype=torch.float32)
    graphs = []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        q = torch.randn(2, 2, 64, 8, generator=g) * (1 + step)
        q[..., 0] += 3 * step  # clusters of other sizes at every step
        q.requires_grad_()
        v = torch.randn(2, 2, 64, 8, generator=g, requires_grad=True)
        layer(q, q, v, rel_pos=rel).square().sum().backward()
        layer.update()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], graphs
