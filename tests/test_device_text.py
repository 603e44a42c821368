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


def test_the_rows_are_local_the_control_the_papers_routing_moba_and_full_seed_by_seed(script, tmp_path) -> None:
    plan = script.Plan(tmp_path, tmp_path, "cuda", "bfloat16", 8192, 2.0, 8.5, steps=1200)
    rows = script.plan_rows([0, 1], plan.specs())
    labels = ["local", "control", "local+routing", "local+moba", "full"]
    assert [(r.label, r.seed) for r in rows] == [(label, seed) for seed in (0, 1) for label in labels]
    assert (plan.num_clusters, plan.routing_window, plan.moba_block) == (91, 90, 30)  # k = round(sqrt(N)), N / k
    configs = {r.label: attention_config(r.spec, 4) for r in rows[:5]}
    assert configs["local+routing"] == {"attention": "local:2,routing:2",
                                        "options": {"routing": {"probes": 1, "balance": 0.0}}}
    # the control: as many keys per query as the routing heads, from a window instead of a cluster
    assert configs["control"] == {"attention": "local:2,longformer:2", "options": {"longformer": {"window": 90}}}
    assert configs["local+moba"] == {"attention": "local:2,moba:2", "options": {"moba": {
        "block": 30, "top_k": 3, "score": "bound", "warmup": script.MOBA_WARMUP, "warmup_len": 2048}}}
    assert plan.overrides(1)[-4:] == ["seed=1", "device=cuda", "precision=bfloat16", "sample_tokens=0"]
    timed = script.Plan(tmp_path, tmp_path, "cuda", "bfloat16", 8192, 2.5, 8.5, budget="time")
    assert timed.overrides(1)[-5:] == ["seed=1", "device=cuda", "precision=bfloat16", "decay_steps=0",
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
    assert seen == [["running"] + ["planned"] * 9, ["done", "running"] + ["planned"] * 8,
                    ["done", "failed", "running"] + ["planned"] * 7,
                    ["done", "failed", "done", "running"] + ["planned"] * 6]
    report = _report(out)
    rows = report["rows"]
    assert [r["status"] for r in rows] == ["done", "failed", "done", "interrupted"] + ["planned"] * 6
    assert rows[1]["note"] == "RuntimeError: CUDA out of memory | tried to allocate 2 GiB"
    assert (rows[0]["steps"], rows[0]["valid"], rows[2]["valid"]) == (10, 2.9, 2.7)
    assert report["settings"]["data"]["name"] == "pg19" and report["settings"]["num_clusters"] == 16
    assert report["machine"]["device"] == "cpu" and report["settings"]["dtype"] == "bfloat16"
    markdown = (out / "report.md").read_text()
    assert "| local | 0 | done | 10 |" in markdown and "| local+routing | 0 | done | 30 |" in markdown
    assert "CUDA out of memory / tried" in markdown  # a | in a note would break the table
    assert "- local+routing: 2.700 bits per byte (seeds [0]), − local -0.200 (spread 0.000, seeds [0])" in markdown
    assert "not judged, 0 seed(s) with both rows" in markdown  # the control failed
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
    assert script.main([str(out), "--toy", "--device", "cpu", "--budget", "time", "--minutes", "1", "--total", "3.5",
                        "--work", str(tmp_path / "work")]) == 0
    rows = _report(out)["rows"]
    assert [r["status"] for r in rows] == ["done"] * 3 + ["skipped"] * 7
    assert rows[3]["note"] == "would end past --total 3.5 min (3.5 min used, 1 + 0.2 min a row)"
    assert [r["wall_s"] for r in rows[:3]] == [70.0] * 3
    settings = _report(out)["settings"]
    assert settings["data"]["name"] == "sympy"  # no --data: sympy (toy: the committed fixture)
    assert settings["dtype"] == "float32"  # on the CPU unless --dtype says otherwise
    assert script.fits(140, 1, 10, 3.5) and not script.fits(141, 1, 10, 3.5)


def test_the_goal_needs_two_seeds_and_routing_below_the_control_by_more_than_their_spread(script) -> None:
    def rows(control: list[float], routing: list[float], local: float = 2.5):
        made = []
        for seed, (a, b) in enumerate(zip(control, routing, strict=True)):
            made += [script.Row("local", "local", seed, "done", valid=local),
                     script.Row("control", "c", seed, "done", valid=a),
                     script.Row("local+routing", "x", seed, "done", valid=b)]
        return made

    met = script.summary(rows([2.0, 2.1], [1.8, 1.85]))
    assert met[0] == "local: 2.500 bits per byte (seeds [0, 1]), − control +0.450 (spread 0.100, seeds [0, 1])"
    assert met[2] == ("local+routing: 1.825 bits per byte (seeds [0, 1]), − local -0.675 (spread 0.050, seeds "
                      "[0, 1]), − control -0.225 (spread 0.100, seeds [0, 1])")
    assert met[-1].startswith("goal") and ": met: local + routing − control -0.225" in met[-1]
    assert "spread 0.100" in met[-1]
    assert ": not met:" in script.summary(rows([2.0, 2.3], [1.9, 2.2]))[-1]  # 0.1 better, spread 0.3
    assert "not judged, 1 seed(s)" in script.summary(rows([2.0], [1.5]))[-1]
    # below all-local heads is not the question: the control must be beaten
    assert ": not met:" in script.summary(rows([1.8, 1.85], [1.8, 1.85]))[-1]


def test_a_resumed_report_keeps_its_done_rows_and_refuses_other_settings(script, tmp_path, monkeypatch) -> None:
    """The rows a report holds as done are not run again (their numbers kept, the report named in the note); the
    rest run; a report of another budget is refused with the difference named."""
    ran = []

    def row_stand_in(row, plan) -> None:
        ran.append((row.label, row.seed))
        row.valid, row.steps, row.run_dir = 2.0, 12, str(tmp_path / "elsewhere")

    monkeypatch.setattr(script, "run_row", row_stand_in)
    first = tmp_path / "first"
    work = ["--work", str(tmp_path / "work")]
    assert script.main([str(first), "--toy", "--device", "cpu", "--seeds", "0", *work]) == 0
    earlier = _report(first)
    earlier["rows"][2]["status"] = "failed"  # local+routing of seed 0 did not finish there
    (first / "report.json").write_text(json.dumps(earlier))
    ran.clear()
    second = tmp_path / "second"
    assert script.main([str(second), "--toy", "--device", "cpu", "--seeds", "0", "1", "--resume",
                        str(first / "report.json"), *work]) == 0
    assert ran == [("local+routing", 0)] + [(label, 1) for label in script.LABELS]
    rows = _report(second)["rows"]
    assert all(r["status"] == "done" for r in rows)
    assert rows[0]["note"].startswith("from report.json") and rows[0]["valid"] == 2.0
    assert rows[0]["run_dir"] is None and rows[5]["run_dir"]  # a resumed row's run directory is not here
    assert _report(second)["analyses"] == []  # no run directory to analyse: the stand-ins wrote none
    code = script.main([str(tmp_path / "third"), "--toy", "--device", "cpu", "--budget", "time", "--resume",
                        str(first / "report.json"), *work])
    assert code == 2


def test_what_cannot_run_is_one_line_naming_it(script, tmp_path, capsys) -> None:
    assert script.main([str(tmp_path / "out"), "--toy", "--device", "cpu", "--data", str(tmp_path / "nothing")]) == 2
    assert "--data " + str(tmp_path / "nothing") + ": not a prepared data set" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert script.main([str(tmp_path / "out"), "--toy"]) == 2
        assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err
