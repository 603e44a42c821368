"""The attention benchmark's new rows (lsh, linear, performer, kernel full attention, their peers) at toy sizes, and
the causal-leak measurement: 0 for causal attention, clearly non-zero for an attention that sees the future."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from routeformer.attention import full_attention
from routeformer.attention.lsh import default_lsh_settings
from routeformer.bench.attention import leaks, reformer_bucket_size, run
from routeformer.bench.leak import causal_leak, leak_positions, verdict

OURS = ["lsh", "linear", "linear-poly2", "performer", "full-elu", "full-poly2"]
PEERS = {"reformer-pytorch (peer)": "reformer_pytorch", "performer-pytorch (peer)": "performer_pytorch"}


def _qkv(n: int = 64, heads: int = 2, head_dim: int = 8) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, n, head_dim, generator=gen) for _ in range(3))


def test_causal_leak_is_zero_for_causal_full_attention() -> None:
    assert causal_leak(lambda q, k, v: full_attention(q, k, v, causal=True), *_qkv()) == 0.0


def test_causal_leak_is_clearly_non_zero_for_non_causal_attention() -> None:
    leak = causal_leak(lambda q, k, v: full_attention(q, k, v, causal=False), *_qkv())
    assert leak > 0.1 and verdict(leak) == "LEAKS"


def test_causal_leak_sees_a_leak_at_the_first_position_only() -> None:
    def first_sees_last(q, k, v):  # causal, except that position 0 also adds the last value
        out = full_attention(q, k, v, causal=True).clone()
        out[..., 0, :] += v[..., -1, :]
        return out

    assert causal_leak(first_sees_last, *_qkv(), positions=[0]) > 0.1
    assert causal_leak(first_sees_last, *_qkv(), positions=[40]) > 0.1  # t = 40 still includes position 0


def test_causal_leak_draws_the_same_random_numbers_in_every_call() -> None:
    def noisy(q, k, v):  # randomness inside the call is not a leak
        return full_attention(q, k, v, causal=True) + torch.randn(())

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
    rows = run([64], heads=2, head_dim=8, window=16, repeats=1, causal=causal, only=OURS, echo=lines.append)
    names = [r["mechanism"] for r in rows]
    assert names[:len(OURS) + 1] == ["full", *OURS]
    for r in rows:
        assert r["fwd_s"] is not None and r["fwd_bwd_s"] is not None, r
    for name, module in PEERS.items():
        assert (name in names) == (importlib.util.find_spec(module) is not None)
    out = "\n".join(lines)
    assert ("causal leak at N=64" in out) == causal
    if causal:
        for row in leaks(64, heads=2, head_dim=8, window=16, only=OURS):
            if "(peer)" not in row["mechanism"]:
                assert row["leak"] is not None and row["leak"] < 1e-5, row


def test_quadratic_kernel_rows_are_skipped_at_long_lengths() -> None:
    rows = run([4100], heads=1, head_dim=4, window=8, repeats=1, only=["full-elu", "full-poly2", "linear-poly2"],
               leak_n=0, echo=lambda _: None)
    skipped = {r["mechanism"]: r["note"] for r in rows if r["note"]}
    assert set(skipped) == {"full-elu", "full-poly2", "linear-poly2"}
    assert all(r["fwd_s"] is None for r in rows if r["note"])


@pytest.mark.skipif(importlib.util.find_spec("reformer_pytorch") is None
                    or importlib.util.find_spec("performer_pytorch") is None, reason="peers not installed")
def test_peers_leak_as_measured() -> None:
    found = {r["mechanism"]: r for r in leaks(128, heads=2, head_dim=8, window=16, only=["lsh", "performer"])}
    for name in PEERS:
        assert found[name]["leak"] > 1e-3 and found[name]["note"] == "LEAKS", found[name]
    assert found["lsh"]["leak"] < 1e-5 and found["performer"]["leak"] == 0.0


def test_the_flex_backend_runs_the_executor_rows_and_they_do_not_leak() -> None:
    """``backend="flex"`` on CPU (FlexAttention's dense eager operator): the rows run, the header says which
    executor ran, and the measured causal leak of every pattern row is zero."""
    executor_rows = ["local", "local+rel", "strided", "fixed", "longformer", "routing"]
    lines: list[str] = []
    rows = run([64], heads=2, head_dim=8, window=16, repeats=1, only=executor_rows, echo=lines.append,
               backend="flex")
    assert [r["mechanism"] for r in rows if "(peer)" not in r["mechanism"]] == ["full", *executor_rows]
    assert all(r["fwd_bwd_s"] is not None for r in rows)
    assert "backend flex" in lines[0]
    for row in leaks(64, heads=2, head_dim=8, window=16, only=executor_rows, backend="flex"):
        if "(peer)" not in row["mechanism"]:
            assert row["leak"] is not None and row["leak"] < 1e-6, row
