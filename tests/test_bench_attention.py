"""The attention benchmark's new rows (lsh, linear, performer, kernel full attention, their peers) at toy sizes, and
the causal-leak measurement: 0 for causal attention, clearly non-zero for an attention that sees the future."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from helpers import routing_layer
from routeformer.attention import Inputs, full_attention
from routeformer.attention.lsh import default_lsh_settings
from routeformer.bench.attention import AttentionBench, leaks, reformer_bucket_size, run
from routeformer.bench.leak import causal_leak, leak_positions, verdict

OURS = ("lsh", "linear", "linear-poly2", "performer", "full-elu", "full-poly2", "cross-routing", "cross-moba")
PEERS = {"reformer-pytorch (peer)": "reformer_pytorch", "performer-pytorch (peer)": "performer_pytorch"}


def _qkv(n: int = 64, heads: int = 2, head_dim: int = 8) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, n, head_dim, generator=gen) for _ in range(3))


def test_causal_leak_is_zero_for_causal_full_attention() -> None:
    assert causal_leak(lambda q, k, v: full_attention(Inputs.of(q, k, v), causal=True), *_qkv()) == 0.0


def test_causal_leak_is_clearly_non_zero_for_non_causal_attention() -> None:
    leak = causal_leak(lambda q, k, v: full_attention(Inputs.of(q, k, v), causal=False), *_qkv())
    assert leak > 0.1 and verdict(leak) == "LEAKS"


def test_causal_leak_sees_a_leak_at_the_first_position_only() -> None:
    def first_sees_last(q, k, v):  # causal, except that position 0 also adds the last value
        out = full_attention(Inputs.of(q, k, v), causal=True).clone()
        out[..., 0, :] += v[..., -1, :]
        return out

    assert causal_leak(first_sees_last, *_qkv(), positions=[0]) > 0.1
    assert causal_leak(first_sees_last, *_qkv(), positions=[40]) > 0.1  # t = 40 still includes position 0


def test_causal_leak_draws_the_same_random_numbers_in_every_call() -> None:
    def noisy(q, k, v):  # randomness inside the call is not a leak
        return full_attention(Inputs.of(q, k, v), causal=True) + torch.randn(())

    assert causal_leak(noisy, *_qkv()) == 0.0


def test_leak_positions_and_verdicts() -> None:
    assert leak_positions(1024) == [0, 341, 511, 1022] and leak_positions(2) == [0]
    assert verdict(0.0) == "none (exactly 0)" and verdict(3e-7) == "rounding" and verdict(float("nan")) == "NaN output"


def test_lsh_and_reformer_settings() -> None:
    assert default_lsh_settings(16384) == (128, 128) and default_lsh_settings(1024) == (32, 32)
    assert default_lsh_settings(96) == (10, 9) and default_lsh_settings(30) == (6, 5)  # sqrt 5.5 -> 5 -> 6
    assert reformer_bucket_size(16384, 128) == 128 and reformer_bucket_size(96, 9) == 8
    assert reformer_bucket_size(95, 9) is None


@pytest.mark.parametrize("causal", [True, False])
def test_new_rows_run_and_ours_do_not_leak(causal: bool) -> None:
    lines: list[str] = []
    rows = run([64], AttentionBench(heads=2, head_dim=8, window=16, repeats=1, causal=causal, only=OURS), lines.append)
    names = [r["mechanism"] for r in rows]
    assert names[:len(OURS) + 1] == ["full", *OURS]
    for r in rows:
        assert r["fwd_s"] is not None and r["fwd_bwd_s"] is not None, r
    for name, module in PEERS.items():
        assert (name in names) == (importlib.util.find_spec(module) is not None)
    out = "\n".join(lines)
    assert ("causal leak at N=64" in out) == causal
    if causal:
        for row in leaks(64, AttentionBench(heads=2, head_dim=8, window=16, only=OURS)):
            if row["mechanism"].startswith("cross-"):  # a memory read whole: no causal order across the two
                assert row["leak"] is None and "memory read whole" in row["note"], row
            elif "(peer)" not in row["mechanism"]:
                assert row["leak"] is not None and row["leak"] < 1e-5, row


def test_documents_follow_each_row_of_ours_with_its_packed_twin_and_a_ratio_table() -> None:
    lines: list[str] = []
    bench = AttentionBench(heads=2, head_dim=8, window=16, repeats=1, leak_n=0, only=("local", "routing", "moba"),
                           documents=4)
    rows = run([64], bench, lines.append)
    names = [r["mechanism"] for r in rows if "(peer)" not in r["mechanism"]]
    assert names == ["full", "full+docs", "local", "local+docs", "routing", "routing+docs", "moba", "moba+docs"]
    for r in rows:
        if r["mechanism"].endswith("+docs"):
            assert r["fwd_s"] is not None and r["fwd_bwd_s"] is not None and "4 documents" in r["settings"], r
            assert r["useful_flops"] is None  # the pattern's counts are of one document a row
    out = "\n".join(lines)
    assert "packed documents: 4 equal documents a row against one" in out
    assert out.count("+docs") >= 4 and "| 64 | routing " in out.split("packed documents:")[1]
    with pytest.raises(ValueError, match=r"--documents \(65\) is more than N \(64\)"):
        run([64], AttentionBench(heads=2, head_dim=8, window=16, repeats=1, leak_n=0, only=("local",), documents=65),
            lines.append)


def test_quadratic_kernel_rows_are_skipped_at_long_lengths() -> None:
    rows = run([4100], AttentionBench(heads=1, head_dim=4, window=8, repeats=1, leak_n=0,
                                      only=("full-elu", "full-poly2", "linear-poly2")), lambda _: None)
    skipped = {r["mechanism"]: r["note"] for r in rows if r["note"]}
    assert set(skipped) == {"full-elu", "full-poly2", "linear-poly2"}
    assert all(r["fwd_s"] is None for r in rows if r["note"])


@pytest.mark.skipif(importlib.util.find_spec("reformer_pytorch") is None
                    or importlib.util.find_spec("performer_pytorch") is None, reason="peers not installed")
def test_peers_leak_as_measured() -> None:
    bench = AttentionBench(heads=2, head_dim=8, window=16, only=("lsh", "performer"))
    found = {r["mechanism"]: r for r in leaks(128, bench)}
    for name in PEERS:
        assert found[name]["leak"] > 1e-3 and found[name]["note"] == "LEAKS", found[name]
    assert found["lsh"]["leak"] < 1e-5 and found["performer"]["leak"] == 0.0


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 13-27 s a worker): CI's slow line runs it
def test_the_flex_backend_runs_the_executor_rows_and_they_do_not_leak() -> None:
    """``backend="flex"`` on CPU (FlexAttention's dense eager operator): the rows run, the header says which
    executor ran, and the measured causal leak of every pattern row is zero."""
    executor_rows = ("local", "local+rel", "strided", "fixed", "longformer", "routing")
    lines: list[str] = []
    rows = run([64], AttentionBench(heads=2, head_dim=8, window=16, repeats=1, only=executor_rows, backend="flex"),
               lines.append)
    assert [r["mechanism"] for r in rows if "(peer)" not in r["mechanism"]] == ["full", *executor_rows]
    assert all(r["fwd_bwd_s"] is not None for r in rows)
    assert "backend flex" in lines[0]
    bench = AttentionBench(heads=2, head_dim=8, window=16, only=executor_rows, backend="flex")
    for row in leaks(64, bench):
        if "(peer)" not in row["mechanism"]:
            assert row["leak"] is not None and row["leak"] < 1e-6, row


# --- the roofline's useful work: each pattern's count of (query, key) pairs equals its mask's -------------------

@pytest.mark.parametrize("n", [1, 37, 130, 300])
def test_useful_pairs_are_the_masks_pairs(n: int) -> None:
    from routeformer.attention.fixed import fixed_mask
    from routeformer.attention.full import full_mask
    from routeformer.attention.local import local_mask
    from routeformer.attention.longformer import longformer_mask
    from routeformer.attention.strided import strided_mask
    from routeformer.bench import roofline as rf

    def per_head(mask: torch.Tensor) -> float:
        return mask.sum().item() / (mask.shape[0] if mask.dim() == 3 else 1)

    assert rf.pairs_full(n) == per_head(full_mask(n))
    for w in (1, 5, 64):
        assert rf.pairs_local(n, w) == per_head(local_mask(n, w))
    for stride in (1, 7, 32):
        for merged in (True, False):
            assert rf.pairs_strided(n, stride, merged) == per_head(strided_mask(n, stride, merged=merged, heads=2))
    for block, summary in ((16, 4), (128, 8), (5, 5)):
        assert rf.pairs_fixed(n, block, summary) == per_head(fixed_mask(n, block, summary))
    for dilations, globals_ in (([1, 2], [0]), ([3], []), ([1, 1, 2, 2], [0])):
        mask = longformer_mask(n, 9, dilations, globals_, causal=True, heads=len(dilations))
        assert rf.pairs_longformer(n, 9, dilations, globals_) == per_head(mask)


@pytest.mark.parametrize("probes", [1, 2])
def test_useful_pairs_of_routing_are_its_masks_pairs(probes: int) -> None:
    from routeformer.bench import roofline as rf

    torch.manual_seed(0)
    layer = routing_layer(2, 8, 4, 5, causal=True, probes=probes, balance=0.0).eval()
    q = torch.randn(2, 2, 50, 8)
    routes = layer.routing.routes(q, q)
    mask = layer.routing_mask(q, q)  # (B, H, N, N): the dense definition
    seen = rf.pairs_in_groups(routes.keys, routes.probes, 5, exclude_self=True)
    assert seen == pytest.approx(mask.sum().item() / 4)


def test_twins_are_timed_call_by_call_in_turn(monkeypatch) -> None:
    """A row and its twin over packed documents are timed together, alternating (a, b, b, a, ...), each after its
    own warm-up; rows without a twin alone."""
    from routeformer.bench import attention as bench_attention
    from routeformer.bench.measure import alternated_median_times

    calls: list[str] = []

    def counting(c):
        def attend(q, k, v):
            calls.append(c.name)
            return c.attend(q, k, v)
        return dataclasses.replace(c, attend=attend)

    real = bench_attention.candidates
    monkeypatch.setattr(bench_attention, "candidates", lambda *a, **kw: [counting(c) for c in real(*a, **kw)])
    paired: list[int] = []

    def recording(fns, repeats, device, **kw):
        paired.append(len(fns))
        return alternated_median_times(fns, repeats, device, warmup_s=0.0, max_warmup=1)

    monkeypatch.setattr(bench_attention, "alternated_median_times", recording)
    bench = AttentionBench(heads=2, head_dim=8, window=16, repeats=4, leak_n=0, only=("local",), documents=4)
    run([64], bench, lambda line: None)
    assert paired == [2, 2, 2, 2]  # full and local with their twins, forward then forward + backward
    local = [n for n in calls if n.startswith("local")]
    # each one's warm-up call, then four rounds in turn: the first forward timings a, b, b, a, a, b, b, a
    assert local[:10] == ["local", "local+docs"] + ["local", "local+docs", "local+docs", "local"] * 2


def test_alternated_median_times_reverses_the_order_every_round() -> None:
    from routeformer.bench.measure import alternated_median_times

    order: list[str] = []
    times = alternated_median_times([lambda: order.append("a"), lambda: order.append("b")], 3, "cpu",
                                    warmup_s=0.0, max_warmup=1)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"] and len(times) == 2 and min(times) >= 0
