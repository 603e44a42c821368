"""scripts/device_text.py, the GPU text rows: the rows it plans (the paper's routing rule, seed by seed), the report
written before and after every row (a failing row does not lose the others, an interruption keeps what finished),
the time guard that keeps the whole inside one device call, and its verdict on the goal. The rows themselves are
stand-ins here; .ci/run runs the script for real at toy sizes on the CPU (``--toy --device cpu``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from routeformer.bench.recall import attention_config
from routeformer.data import prepare

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_text.py"
FIXTURE_PG19 = Path(__file__).parent / "fixtures" / "pg19"


@pytest.fixture()
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("device_text", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "device_text", module)
    spec.loader.exec_module(module)
    return module


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_the_rows_are_local_the_papers_routing_and_full_seed_by_seed(script, tmp_path) -> None:
    rows = script.plan_rows([0, 1])
    assert [(r.label, r.seed) for r in rows] == [("local", 0), ("local+routing", 0), ("full", 0),
                                                 ("local", 1), ("local+routing", 1), ("full", 1)]
    assert attention_config(rows[1].spec, 4) == {"attention": "local:2,routing:2",
                                                 "options": {"routing": {"probes": 1, "balance": 0.0}}}
    plan = script.Plan(tmp_path, tmp_path, "cuda", "bfloat16", 8192, 2.5, 9.5)
    assert (plan.num_clusters, plan.routing_window) == (91, 90)  # k = round(sqrt(N)), N / k keys
    assert plan.overrides(1)[-5:] == ["seed=1", "device=cuda", "precision=bfloat16", "decay_steps=0",
                                      "sample_tokens=0"]


def test_the_report_is_written_after_every_row_and_keeps_what_finished(script, tmp_path, monkeypatch,
                                                                       capsys) -> None:
    """Stand-in rows: the second fails (its error in the report, the third still runs), the fourth is interrupted
    (exit 130; the rows before it stay, the rest stay planned). Each row starts with the report on disk saying
    which rows are done and that it runs."""
    prepare("pg19", tmp_path / "data", str(FIXTURE_PG19))
    out = tmp_path / "out"
    seen: list[list[str]] = []

    def row_stand_in(row, plan) -> None:
        seen.append([r["status"] for r in _report(out)["rows"]])
        assert (plan.data_name, plan.seq_len, plan.device) == ("pg19", 256, "cpu")
        if len(seen) == 2:
            raise RuntimeError("CUDA out of memory | tried to allocate 2 GiB\nsecond line")
        if len(seen) == 4:
            raise KeyboardInterrupt
        row.steps, row.train_minutes, row.valid, row.unit = 10 * len(seen), 0.1, 3.0 - 0.1 * len(seen), "bpb"

    monkeypatch.setattr(script, "run_row", row_stand_in)
    code = script.main([str(out), "--toy", "--device", "cpu", "--dtype", "bfloat16", "--data",
                        str(tmp_path / "data" / "pg19"), "--work", str(tmp_path / "work")])
    assert code == 130
    assert seen == [["running"] + ["planned"] * 5, ["done", "running"] + ["planned"] * 4,
                    ["done", "failed", "running"] + ["planned"] * 3, ["done", "failed", "done", "running", "planned",
                                                                      "planned"]]
    report = _report(out)
    rows = report["rows"]
    assert [r["status"] for r in rows] == ["done", "failed", "done", "interrupted", "planned", "planned"]
    assert rows[1]["note"] == "RuntimeError: CUDA out of memory | tried to allocate 2 GiB"
    assert (rows[0]["steps"], rows[0]["valid"], rows[2]["valid"]) == (10, 2.9, 2.7)
    assert report["settings"]["data"]["name"] == "pg19" and report["settings"]["num_clusters"] == 16
    assert report["machine"]["device"] == "cpu" and report["settings"]["dtype"] == "bfloat16"
    markdown = (out / "report.md").read_text()
    assert "| local | 0 | done | 10 |" in markdown and "| full | 0 | done | 30 |" in markdown
    assert "CUDA out of memory / tried" in markdown  # a | in a note would break the table
    assert "- seed 0: full − local -0.200 bits per byte" in markdown  # local+routing failed: no difference
    assert "not judged, 0 seed(s) with both rows" in markdown
    assert "interrupted" in capsys.readouterr().err


def test_rows_that_would_end_past_the_total_are_skipped(script, tmp_path, monkeypatch) -> None:
    """1-minute rows taking 70 s each (10 s beyond their training), a 3.5-minute total: three rows fit, the other
    three are reported as skipped. The first row is planned with FIRST_OVERHEAD_S, the later with what was seen."""
    now = [0.0]
    monkeypatch.setattr(script, "clock", lambda: now[0])
    monkeypatch.setattr(script, "FIRST_OVERHEAD_S", 10.0)

    def row_stand_in(row, plan) -> None:
        now[0] += 70.0
        row.valid = 2.0

    monkeypatch.setattr(script, "run_row", row_stand_in)
    out = tmp_path / "out"
    assert script.main([str(out), "--toy", "--device", "cpu", "--minutes", "1", "--total", "3.5",
                        "--work", str(tmp_path / "work")]) == 0
    rows = _report(out)["rows"]
    assert [r["status"] for r in rows] == ["done"] * 3 + ["skipped"] * 3
    assert rows[3]["note"] == "would end past --total 3.5 min (3.5 min used, 1 + 0.2 min a row)"
    assert [r["wall_s"] for r in rows[:3]] == [70.0] * 3
    settings = _report(out)["settings"]
    assert settings["data"]["name"] == "sympy"  # no --data: sympy (toy: the committed fixture)
    assert settings["dtype"] == "float32"  # on the CPU unless --dtype says otherwise
    assert script.fits(140, 1, 10, 3.5) and not script.fits(141, 1, 10, 3.5)


def test_the_goal_needs_two_seeds_and_a_gap_larger_than_their_spread(script) -> None:
    def rows(local: list[float], routing: list[float]):
        made = []
        for seed, (a, b) in enumerate(zip(local, routing, strict=True)):
            made += [script.Row("local", "local", seed, "done", valid=a),
                     script.Row("local+routing", "x", seed, "done", valid=b)]
        return made

    met = script.summary(rows([2.0, 2.1], [1.8, 1.85]))
    assert met[:2] == ["seed 0: local+routing − local -0.200 bits per byte",
                       "seed 1: local+routing − local -0.250 bits per byte"]
    assert met[2].startswith("goal") and ": met: local + routing − local -0.225" in met[2] and "spread 0.100" in met[2]
    assert ": not met:" in script.summary(rows([2.0, 2.3], [1.9, 2.2]))[-1]  # 0.1 better, spread 0.3
    assert "not judged, 1 seed(s)" in script.summary(rows([2.0], [1.5]))[-1]


def test_what_cannot_run_is_one_line_naming_it(script, tmp_path, capsys) -> None:
    assert script.main([str(tmp_path / "out"), "--toy", "--device", "cpu", "--data", str(tmp_path / "nothing")]) == 2
    assert "--data " + str(tmp_path / "nothing") + ": not a prepared data set" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert script.main([str(tmp_path / "out"), "--toy"]) == 2
        assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err
