"""The command line: help text and the attention benchmark at toy sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from routeformer.attention import PATTERNS
from routeformer.cli import main


def test_bench_attention_prints_a_table_for_every_pattern(capsys) -> None:
    assert main(["bench", "attention", "--n", "64", "96", "--repeats", "1", "--heads", "2", "--head-dim", "8",
                 "--window", "16"]) == 0
    out = capsys.readouterr().out
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
    out = capsys.readouterr().out
    for name in ("full", "local", "local+routing"):
        assert f"| {name} " in out
    assert "tokens/s" in out and "ms/token at 32" in out and "ms/token at 96" in out
