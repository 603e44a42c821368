"""The quality benchmarks at toy sizes: the recall table and the text table have their rows and columns, and bad
settings are refused with the reason (their numbers are the benchmark's business, not a test's)."""

from __future__ import annotations

import pytest

from routeformer.bench.recall import attention_config
from routeformer.cli import main
from routeformer.data import prepare


def test_bench_recall_prints_a_row_per_task_and_attention(capsys) -> None:
    assert main(["bench", "recall", "--tasks", "passkey", "mqar", "--attention", "local", "local+routing/separate",
                 "--seq-len", "48", "--gap", "12", "--window", "4", "--dim", "16", "--steps", "2", "--batch", "2",
                 "--eval", "4"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("| task"):].splitlines()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table[2:]]
    assert [(r[0], r[1]) for r in rows] == [("passkey", "local"), ("passkey", "local+routing/separate"),
                                            ("mqar", "local"), ("mqar", "local+routing/separate")]
    local, routed = rows[0], rows[1]
    assert local[3] == routed[3] == "6.2"  # chance: 1 / 16 values
    assert local[6] == "4.0" and local[7] == "-" and local[9] == "-"  # no routing heads, no routing diagnostics
    assert local[10] == "local: window=4"
    # k = round(sqrt(48)) = 7, window 48 // 7 = 6; a separate routing head runs two events per position, each
    # routed by k centroids and scoring its window
    assert "routing: k=7, w=6, separate" in routed[10] and float(routed[6]) == (4 + 4 + 2 * 2 * (6 + 7)) / 4
    assert 0 <= float(routed[8]) <= 100 and 0 <= float(routed[9]) <= float(routed[8])


@pytest.mark.parametrize("args, message", [
    (["--gap", "13", "--window", "8"], "gap (13) must be at least depth × (window - 1) = 14"),
    (["--tasks", "copy"], "unknown task 'copy'"),
    (["--attention", "local+routing/mixed"], "unknown routing variant 'mixed'"),
])
def test_bench_recall_refuses_what_would_not_test_reach(args, message, capsys) -> None:
    assert main(["bench", "recall", "--steps", "1", *args]) != 0
    assert message in capsys.readouterr().err


def test_attention_rows_name_their_routing() -> None:
    assert attention_config("local+routing", 4) == {"attention": "local:2,routing:2"}
    assert attention_config("local+routing/separate", 8) == {"attention": "local:4,routing:4", "shared_qk": False,
                                                             "separate_routing": True}
    assert attention_config("full", 4) == {"attention": "full"}


def test_bench_text_trains_each_attention_on_the_same_budget(tmp_path, capsys) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("".join(f"{i}: def f(x): return x * {i}\n" for i in range(400)))
    prepare("text", tmp_path / "data", str(corpus), dataset_name="tiny")
    assert main(["bench", "text", "--attention", "local", "local+routing", "--seq-len", "32", "--window", "8",
                 "--steps", "3", "--minutes", "1", "--data", "tiny", "--data-dir", str(tmp_path / "data"),
                 "--out", str(tmp_path / "runs"), "--set", "dim=16", "--set", "depth=1", "--set", "eval_every=100",
                 "--set", "warmup_steps=1", "--set", "batch_size=2"]) == 0
    out = capsys.readouterr().out
    assert "| local " in out and "| local+routing " in out and "k=6, w=5" in out
    assert out.count("bits per byte") >= 2 and (tmp_path / "runs" / "local").is_dir()
