"""MoBA heads (``attention/moba.py``) and the block selection they share with the NSA-style kind (``blocks.py``):
the selection against its definition written out with loops, every executor against the dense float64 reference
(forward and gradients), no leak, exact decoding, the warm-up, the cost, the options' errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import compare_with_reference, leaks, rand_qkv, rand_rel
from routeformer import TransformerConfig, TransformerLM
from routeformer.attention import get_kind
from routeformer.attention.blocks import NONE, block_bounds, block_means, block_scores, select_blocks, selected_mask
from routeformer.attention.moba import MobaHeads, MobaOptions, keys_per_query
from routeformer.executors import EXECUTORS, get_executor
from routeformer.executors.fused.selection import fused_select_blocks
from routeformer.testing import check_kind


def _score(q, keys, score: str) -> float:
    """MoBA's q · mean key, or Quest's bound: the largest q · x over the box of the keys' per-channel ranges."""
    if score == "mean":
        return float(q @ keys.mean(0))
    lo, hi = keys.min(0).values, keys.max(0).values
    return float(sum(max(q[d] * lo[d], q[d] * hi[d]) for d in range(q.numel())))


def _selection_by_loops(q, k, block: int, top: int, score: str) -> list:
    """The selection as the papers state it, one query at a time: the `top` complete earlier blocks by score."""
    B, H, N, _ = q.shape
    out = []
    for b in range(B):
        for h in range(H):
            for i in range(N):
                scored = [(_score(q[b, h, i], k[b, h, j * block:(j + 1) * block], score), j)
                          for j in range(i // block)]
                out.append({j for _, j in sorted(scored, reverse=True)[:top]})
    return out


def _select_with(select_run, monkeypatch) -> None:
    """The CPU's executor (``fused``, what ``auto`` resolves to) with another ``select_run``."""
    monkeypatch.setitem(EXECUTORS, "fused", dataclasses.replace(EXECUTORS["fused"], select_run=select_run))


def _selection_by(path: str, monkeypatch) -> None:
    """MobaHeads.select on one path: the fused CPU kernel (the executor's select_run, which must take the call) or
    PyTorch's operators (an executor without one)."""

    def fused(*args, **kwargs):
        chosen = fused_select_blocks(*args, **kwargs)
        assert chosen is not None, "the fused kernel did not take the call"
        return chosen

    _select_with(fused if path == "fused" else None, monkeypatch)


@pytest.mark.parametrize("path", ["fused", "pytorch"])
@pytest.mark.parametrize("score", ["mean", "bound"])
@pytest.mark.parametrize("n, block, top", [(40, 8, 2), (37, 5, 3), (12, 16, 2), (30, 3, 1), (40, 4, 6)])  # 6: topk
def test_the_selection_is_the_definition(n: int, block: int, top: int, score: str, path: str, monkeypatch) -> None:
    _selection_by(path, monkeypatch)
    q, k, _ = rand_qkv(2, 2, n, 6, grad=False)
    chosen = MobaHeads(2, 6, MobaOptions(block=block, top_k=top, score=score)).select(q, k)
    assert chosen.shape == (2, 2, n, top)  # a fixed shape, NONE where fewer candidates
    got = [{j for j in row.tolist() if j != NONE} for row in chosen.reshape(-1, top)]
    assert got == _selection_by_loops(q, k, block, top, score)
    mask = selected_mask(chosen, block)
    i = torch.arange(n)
    for b, h, qi in [(0, 0, n - 1), (1, 1, n // 2), (0, 1, 0)]:
        own = (i // block == qi // block) & (i <= qi)
        picked = torch.zeros(n, dtype=torch.bool)
        for j in got[(b * 2 + h) * n + qi]:
            picked[j * block:(j + 1) * block] = True
        assert torch.equal(mask[b, h, qi], own | picked)
    assert not mask.triu(1).any()  # causal by construction


@pytest.mark.parametrize("backend", ["tiles", "fused", "flex"])
@pytest.mark.parametrize("n, block, top, relative, score", [(40, 8, 2, False, "mean"), (37, 5, 3, True, "bound"),
                                                            (300, 16, 3, True, "mean")])
def test_every_executor_computes_the_definition(backend: str, n: int, block: int, top: int, relative: bool,
                                                score: str) -> None:
    heads = MobaHeads(2, 8, MobaOptions(block=block, top_k=top, score=score)).double()
    heads.executor = get_executor(backend)
    q, k, v = rand_qkv(2, 2, n, 8)
    mask = heads.reference_mask(q.detach(), k.detach())
    compare_with_reference(lambda q, k, v, key_padding_mask, rel_pos: heads(q, k, v, rel_pos), mask, q, k, v,
                           rel_pos=rand_rel(8, 6) if relative else None)


@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_no_leak(backend: str) -> None:
    heads = MobaHeads(2, 8, MobaOptions(block=6, top_k=2)).double()
    heads.executor = get_executor(backend)
    q, k, v = rand_qkv(1, 2, 50, 8, grad=False)
    for t in (0, 5, 6, 23, 48):
        assert not leaks(lambda q, k, v: heads(q, k, v, None), q, k, v, t, atol=1e-12), f"leaks into {t}"


@pytest.mark.parametrize("path", ["fused", "pytorch"])
def test_a_broken_selection_is_caught(path: str, monkeypatch) -> None:
    """Held to its definition: a kind that selects the *worst* blocks fails the reference check."""
    import routeformer.attention.moba as moba

    _selection_by(path, monkeypatch)
    check_kind("moba", seq_len=40, options={"moba": {"block": 5, "top_k": 2}}, rel_clip=8)
    if path == "fused":
        _select_with(lambda q, k, block, top, bound, documents=None: fused_select_blocks(-q, k, block, top, bound,
                                                                                        documents), monkeypatch)
    else:
        monkeypatch.setattr(moba, "select_blocks", lambda scores, block, top, pos=None, **kw: select_blocks(
            -scores, block, top, pos, **kw))
    monkeypatch.setattr(MobaHeads, "reference_mask", lambda self, q, k: selected_mask(
        select_blocks(torch.einsum("bhnd,bhmd->bhnm", q, block_means(k, self.block)), self.block, self.top_k),
        self.block))
    with pytest.raises(AssertionError, match="moba heads fail the reference check"):
        check_kind("moba", seq_len=40, options={"moba": {"block": 5, "top_k": 2}}, rel_clip=8)


@pytest.mark.parametrize("options", [{"block": 5, "top_k": 2}, {"block": 8, "top_k": 1, "warmup": 2},
                                     {"top_k": 3}, {"block": 6, "top_k": 2, "score": "bound"}])
def test_the_generic_checks(options: dict) -> None:
    report = check_kind("moba", seq_len=40, options={"moba": options}, rel_clip=8)
    assert max(report.reference, report.reference_grad, report.leak, report.decode) <= 1e-9


@pytest.mark.parametrize("score", ["mean", "bound"])
def test_decoding_reproduces_the_forward_through_the_warm_up(score: str) -> None:
    config = TransformerConfig(vocab_size=31, dim=32, depth=2, heads=4, seq_len=48, rel_clip=6,
                               attention="local:2,moba:2", options={"local": {"window": 6},
                                                                    "moba": {"block": 6, "top_k": 2, "warmup": 1,
                                                                             "score": score}})
    torch.manual_seed(0)
    model = TransformerLM(config).double().eval()
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)
    tokens = torch.randint(0, 31, (2, 48))
    for phase in ("warm-up", "selecting"):
        with torch.no_grad():
            full = model(tokens)
            cache = model.new_cache(2, 48)
            steps = [model(tokens[:, :20], cache)] + [model(tokens[:, t:t + 1], cache)
                                                            for t in range(20, 48)]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10, msg=phase)
        assert model.head_groups()[1].warming_up == (phase == "warm-up")
        model.after_optimizer_step()


def test_the_warm_up_is_counted_and_trains_on_short_sequences() -> None:
    config = TransformerConfig(vocab_size=31, dim=32, depth=1, heads=2, seq_len=64, attention="local:1,moba:1",
                               options={"local": {"window": 8},
                                        "moba": {"block": 8, "top_k": 2, "warmup": 3, "warmup_len": 16}})
    assert [config.train_len(s) for s in (0, 2, 3)] == [16, 16, 64]
    model = TransformerLM(config)
    group = model.head_groups()[1]
    dense = model.flops_per_token(64, step=0)
    assert model.flops_per_token(64, step=3) < dense
    for _ in range(3):
        assert group.warming_up
        assert model.after_optimizer_step() == 1
    assert not group.warming_up and model.after_optimizer_step() == 0
    restored = TransformerLM(config)
    restored.load_state_dict(model.state_dict())  # a saved run resumes after its warm-up
    assert not restored.head_groups()[1].warming_up


def test_keys_per_query_counts_the_selection() -> None:
    o = MobaOptions(block=8, top_k=3)
    n = 128
    per_query = []
    for i in range(n):
        earlier = i // 8
        per_query.append(min(earlier, 3) * 8 + (8 + 1) / 2 + earlier)  # chosen blocks, own block, block scores
    assert keys_per_query(o, n) == pytest.approx(sum(per_query) / n)
    config = TransformerConfig(seq_len=128, dim=32, heads=2, attention="moba", options={"moba": {"block": 8}})
    assert config.keys_per_query()["moba"] == pytest.approx(keys_per_query(o, 128))
    assert get_kind("moba").cost(config.options["moba"], 128, step=0) == keys_per_query(o, 128)  # no warm-up


@pytest.mark.parametrize("options, message", [
    ({"block": 0}, r"options.moba: block must be a positive integer"),
    ({"top_k": 0}, r"options.moba: top_k must be a positive integer"),
    ({"block": 100}, r"options.moba: block \(100\) is larger than seq_len \(64\)"),
    ({"warmup": 5, "warmup_len": 24}, r"options.moba: warmup_len \(24\) must divide seq_len \(64\)"),
    ({"blocks": 4}, r"options.moba: unknown field\(s\) \['blocks'\]"),
    ({"score": "max"}, r"options.moba: score must be one of 'mean', 'bound', got 'max'"),
])
def test_options_are_checked_by_name(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TransformerConfig(seq_len=64, dim=32, heads=2, attention="moba", options={"moba": options})


def test_reach_says_whether_the_needed_key_is_seen() -> None:
    heads = MobaHeads(1, 8, MobaOptions(block=4, top_k=1)).double()
    q, k, _ = rand_qkv(1, 1, 32, 8, grad=False)
    best = int(heads.select(q, k)[0, 0, 30, 0])  # query 30's one selected block
    other = next(j for j in range(7) if j != best)
    rows = torch.zeros(4, dtype=torch.long)
    cols = torch.tensor([30, 30, 30, 30])
    sources = torch.tensor([best * 4 + 1, other * 4 + 2, 29, 28])  # selected, unselected, own block (28-30)
    seen = [float(heads.reach(q, k, rows[i:i + 1], cols[i:i + 1], sources[i:i + 1])["in_window"]) for i in range(4)]
    assert seen == [1.0, 0.0, 1.0, 1.0]


# --- the fused selection against PyTorch's --------------------------------------------------------------------------


def _pytorch_select(q, k, block: int, top: int, score: str):
    summary = block_bounds(k, block) if score == "bound" else (block_means(k, block),)
    return select_blocks(block_scores(q, summary, score), block, top)


@pytest.mark.parametrize("score", ["mean", "bound"])
@pytest.mark.parametrize("n, d, block, top", [(300, 16, 16, 1), (300, 16, 16, 3), (257, 33, 8, 5), (64, 7, 8, 9),
                                              (5, 4, 8, 2), (200, 20, 1, 2)])
def test_the_fused_selection_is_pytorchs_in_float64(n: int, d: int, block: int, top: int, score: str) -> None:
    """The same picks, in the same order (ties to the lower block), NONE where fewer candidates; q and k strided as
    the model hands them over (heads split from the projection's rows)."""
    g = torch.Generator().manual_seed(n + top)
    q, k = (torch.randn(2, n, 3, d, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    chosen = fused_select_blocks(q, k, block, top, bound=score == "bound")
    assert chosen is not None and chosen.shape == (2, 3, n, top)
    assert torch.equal(chosen, _pytorch_select(q, k, block, top, score))


@pytest.mark.parametrize("score", ["mean", "bound"])
def test_the_fused_selection_in_float32_picks_the_best_blocks(score: str) -> None:
    """In float32 the kernel sums the scores in another order: each pick's exact score (float64) is within
    rounding of the best remaining one's."""
    q, k, _ = rand_qkv(2, 2, 512, 32, dtype=torch.float32, grad=False)
    chosen = fused_select_blocks(q, k, 32, 3, bound=score == "bound")
    q64, k64 = q.double(), k.double()
    summary = block_bounds(k64, 32) if score == "bound" else (block_means(k64, 32),)
    exact = block_scores(q64, summary, score)  # (B, H, N, nb)
    expected = _pytorch_select(q64, k64, 32, 3, score)
    assert torch.equal(chosen == NONE, expected == NONE)
    got, want = (exact.gather(-1, x.clamp(min=0)).where(x >= 0, 0.0) for x in (chosen, expected))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (chosen != expected).float().mean() < 0.01  # a near-tie may fall the other way, rarely


def test_the_fused_selection_is_the_same_at_one_and_two_threads() -> None:
    threads = torch.get_num_threads()
    q, k, _ = rand_qkv(3, 4, 700, 16, dtype=torch.float32, grad=False)
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(fused_select_blocks(q, k, 16, 2, bound=True))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*results)


def test_the_fused_selection_names_what_is_wrong() -> None:
    ops = torch.ops.routeformer_fused
    q, k, _ = rand_qkv(1, 2, 16, 4, grad=False)
    with pytest.raises(RuntimeError, match=r"select_blocks: block must be >= 1, got 0"):
        ops.select_blocks(q, k, 0, 1, True, None)
    with pytest.raises(RuntimeError, match=r"select_blocks: top must be >= 1, got -1"):
        ops.select_blocks(q, k, 4, -1, True, None)
    with pytest.raises(RuntimeError, match=r"select_blocks: k must be \(B, H, N, D\) like q"):
        ops.select_blocks(q, k[:, :, :8], 4, 1, True, None)
    with pytest.raises(RuntimeError, match=r"select_blocks: k must be Double, got Float"):
        ops.select_blocks(q, k.float(), 4, 1, True, None)
    with pytest.raises(RuntimeError, match=r"select_blocks: documents must be \(B, N\) = \(1, 16\)"):
        ops.select_blocks(q, k, 4, 1, True, torch.zeros(1, 8, dtype=torch.long))
