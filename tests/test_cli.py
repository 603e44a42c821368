"""The command line: help text and the attention benchmark at toy sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import banner, executor_named
from routeformer.attention import PATTERNS
from routeformer.cli import main
from routeformer.executors import describe_backend, resolve_backend


def test_bench_attention_prints_a_table_for_every_pattern(capsys) -> None:
    assert main(["bench", "attention", "--n", "64", "96", "--repeats", "1", "--heads", "2", "--head-dim", "8",
                 "--window", "16"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    # the line naming the executor, on stderr (stdout keeps the tables), once
    assert banner(captured.err) == describe_backend("auto", "cpu") and captured.err.count("attention: ") == 1
    assert banner(captured.err).startswith(executor_named()) and "attention: " not in out
    for n in ("64", "96"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {n} ") or line.startswith(f"|  {n} ")]
        names = {row.split("|")[2].strip() for row in rows}
        assert set(PATTERNS) <= names, names
    assert "speed-up vs full" in out and "1.00×" in out
    assert "routing" in names and "training peak memory ~ N^b" in out


def test_bench_rejects_bad_sizes(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--n", "0"])
    assert "positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--help"], *([cmd, "--help"] for cmd in ("prepare", "train", "evaluate", "sample",
                                                                          "bench")),
                                  ["bench", "attention", "--help"], ["bench", "model", "--help"],
                                  ["bench", "recall", "--help"], ["bench", "text", "--help"]])
def test_help(args: list[str]) -> None:
    """`python -m routeformer` runs the command line; every subcommand has --help."""
    done = subprocess.run([sys.executable, "-m", "routeformer", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: routeformer" in done.stdout


def test_bench_model_prints_training_and_generation_tables(capsys) -> None:
    assert main(["bench", "model", "--n", "64", "128", "--positions", "32", "96", "--dim", "32", "--depth", "1",
                 "--heads", "4", "--window", "16", "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert banner(captured.err) == describe_backend("auto", "cpu") and captured.err.count("attention: ") == 1
    for name in ("full", "local", "local+routing"):
        assert f"| {name} " in out
    assert "tokens/s" in out and "ms/token at 32" in out and "ms/token at 96" in out


def test_the_banner_names_the_executor_asked_for(capsys) -> None:
    assert main(["bench", "attention", "--n", "64", "--repeats", "1", "--heads", "2", "--head-dim", "8", "--window",
                 "16", "--only", "local", "--backend", "tiles"]) == 0
    assert banner(capsys.readouterr().err) == "attention: tiles (asked for)"


def test_the_banner_says_tiles_where_the_fused_kernel_does_not_run() -> None:
    """The fused executor hands calls off the CPU, and in dtypes other than float32 / float64, to tiles: the line
    says so (for a float32 call on the CPU it names the kernel, as the banner tests above check)."""
    from routeformer import TransformerConfig

    assert describe_backend("fused", "meta") == ("attention: tiles (fused asked for, but its kernels run on the CPU "
                                                 "only, not meta)")
    assert describe_backend("tiles", "cpu", torch.bfloat16) == "attention: tiles (asked for)"
    if resolve_backend("auto", "cpu") == "fused":
        assert describe_backend("auto", "cpu", torch.bfloat16) == ("attention: tiles (the fused kernel takes "
                                                                   "float32 and float64, not bfloat16)")
        assert describe_backend("auto", "cpu", torch.float64) == describe_backend("auto", "cpu")
    local = TransformerConfig(dim=32, heads=2, depth=1, attention="local", options={"local": {"window": 8}})
    assert local.describe_executor("cpu") == describe_backend("auto", "cpu")
    linear = TransformerConfig(dim=32, heads=2, depth=1, attention="linear", positions="absolute")
    assert linear.describe_executor("cpu") == "attention: no executor (the linear heads compute their own way)"

