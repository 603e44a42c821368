"""scripts/device_check.py: each step's status, seconds, numbers and output tail; a failing or hanging step never
stops the check; the report on disk after every step; the numbers read from pytest and the attention benchmark,
those of a step cut by its limit from the lines it printed; the GPU plan within its 9 minutes. (The whole check at
toy sizes runs in CI: .ci/run.)"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"


@pytest.fixture(scope="module")
def dc():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["device_check"]


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _steps(dc, out: Path) -> list:
    pid_file = out / "sleeper.pid"
    return [
        dc.Step("ok", "prints a number", _py("print('VALUE 42')"), 60,
                parse=lambda output, _: {"value": int(output.split("VALUE ")[1].split()[0])}),
        dc.Step("bad", "fails", _py("import sys; print('broken'); sys.exit(3)"), 60),
        # a step that hangs, with a child of its own: the time limit ends both
        dc.Step("hangs", "sleeps", _py(
            "import subprocess, sys, time\n"
            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "print('waiting', flush=True)\n"
            "time.sleep(120)"), 3),
        # reads the report the check wrote after the steps before it
        dc.Step("reads", "reads the report so far", _py(
            f"import json; print('SEEN', [s['status'] for s in json.load(open({str(out / 'report.json')!r}))"
            f"['steps']])"), 60,
            parse=lambda output, _: {"seen": output.split("SEEN ")[1].strip()}),
        dc.Step("unreadable", "its numbers cannot be read", _py("pass"), 60, parse=lambda output, _: {}["missing"]),
    ]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting for its reaper does not), after up to 5 s."""
    deadline = time.monotonic() + 5
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


def test_every_step_is_recorded_and_none_stops_the_check(dc, tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "check"
    monkeypatch.setattr(dc, "plan", lambda mode, part: _steps(dc, mode.out))
    assert dc.main([str(out), "--toy", "--device", "cpu"]) == 1  # one step failed, one timed out
    table = json.loads((out / "report.json").read_text())
    steps = {s["name"]: s for s in table["steps"]}
    assert [s["status"] for s in table["steps"]] == ["pass", "fail", "timeout", "pass", "pass"]
    assert steps["ok"]["numbers"] == {"value": 42} and steps["ok"]["returncode"] == 0
    assert steps["bad"]["returncode"] == 3 and "broken" in steps["bad"]["tail"]
    assert steps["hangs"]["seconds"] < 30 and "waiting" in steps["hangs"]["tail"]
    assert "stopped at its time limit of 3 s" in steps["hangs"]["tail"]
    assert not _alive(int((out / "sleeper.pid").read_text()))  # the step's own child ended with it
    assert steps["reads"]["numbers"] == {"seen": "['pass', 'fail', 'timeout', 'not run', 'not run']"}
    assert steps["unreadable"]["numbers"] == {"unread": "KeyError: 'missing'"}
    assert steps["ok"]["command"].endswith("print('VALUE 42')") and (out / "logs" / "bad.log").is_file()
    md = (out / "report.md").read_text()
    assert "| ok | pass |" in md and "| hangs | timeout |" in md and '"value": 42' in md
    assert "not passed: bad, hangs" in capsys.readouterr().err


def test_usage_errors(dc, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        dc.main([str(tmp_path), "--device", "cpu"])
    assert stop.value.code == 2 and "--device cpu runs the toy sizes only" in capsys.readouterr().err


def test_each_part_of_the_gpu_check_fits_nine_minutes_and_together_they_run_every_step(dc, tmp_path: Path) -> None:
    """A GPU is lent for 15 minutes, its start-up included: each part's limits add up to under 9 minutes."""
    gpu, toy = (dc.plan(dc.Mode(device, device == "cpu", tmp_path)) for device in ("cuda", "cpu"))
    parts = {part: dc.plan(dc.Mode("cuda", False, tmp_path), part) for part in ("check", "bench", "cpu", "routing")}
    assert all(sum(s.limit_s for s in steps) <= 540 for steps in parts.values())
    # the kernels against PyTorch before anything is timed, then the goals' lengths; a budget cuts the end
    assert [s.name for s in parts["routing"]] == ["versions", "routing-kernels", "bench-65536", "bench-262144",
                                                  "profile", "routing-tests", "flex-cost"]
    routing = {s.name: s for s in parts["routing"]}
    kernels = routing["routing-kernels"]
    assert kernels.env == {"ROUTEFORMER_TEST_DEVICE": "cuda"}  # compiled, not interpreted
    assert {"tests/test_flex_router.py", "tests/test_flex_rows.py", "--tb=short"} <= set(kernels.argv)
    assert "-n" not in kernels.argv and "tests/test_cuda.py" in routing["routing-tests"].argv
    assert routing["profile"].argv[-2:] == ["65536", "cuda"]
    assert all("--leak-n" in routing[f"bench-{n}"].argv for n in (65536, 262144))
    assert routing["flex-cost"].argv[-3:] == ["65536", "--device", "cuda"]
    assert {"local", "routing", "routing-p2", "sdpa-cudnn"} <= set(routing["bench-262144"].argv)
    assert {"lsh", "moba"} <= set(routing["bench-65536"].argv) and "moba" not in routing["bench-262144"].argv
    assert [s.name for s in parts["check"]] == ["versions", "env", "prepare", "tests", "train", "ddp", "fsdp"]
    assert [s.name for s in parts["bench"]] == ["versions", "env", "bench-16384", "bench-65536", "profile"]
    assert [s.name for s in parts["cpu"]] == ["versions", "env", "suite"]
    assert [s.name for s in gpu] == ["versions", "env", "prepare", "tests", "bench-16384", "bench-65536", "profile",
                                     "train", "ddp", "fsdp", "suite"]
    assert [s.name for s in toy] == ["versions", "env", "prepare", "tests", "bench-256", "bench-512", "profile",
                                     "train", "ddp", "fsdp"]  # CI runs the suite itself
    steps = {s.name: s for s in gpu}
    assert steps["tests"].env == {"ROUTEFORMER_TEST_DEVICE": "cuda"} and "-m" in steps["tests"].argv
    # the suite as the README runs it (its pytest options kept: not slow), on the CPU with the GPU hidden
    assert "addopts=" not in " ".join(steps["suite"].argv) and steps["suite"].env["CUDA_VISIBLE_DEVICES"] == ""
    bench = steps["bench-65536"].argv
    assert bench[bench.index("--device") + 1] == "cuda" and bench[bench.index("--dtype") + 1] == "bfloat16"
    assert {"local", "routing", "routing-p2", "lsh", "sdpa-flash", "sdpa-cudnn"} <= set(bench)
    train = " ".join(steps["train"].argv)
    assert "seq_len=4096" in train and 'precision="bfloat16"' in train and steps["train"].env["TORCH_LOGS"]
    assert "--fsdp" in steps["fsdp"].argv and "torch.distributed.run" in steps["ddp"].argv


def test_pytest_outcomes_are_read_with_and_without_workers(dc) -> None:
    plain = ("tests/test_cuda.py::test_a PASSED [ 50%]\ntests/test_cuda.py::test_b[x-1] FAILED [100%]\n"
             "==== 1 failed, 1 passed in 3.10s ====\n")
    workers = ("[gw0] [ 50%] PASSED tests/test_cuda.py::test_a \n[gw1] [100%] SKIPPED tests/test_flex.py::test_c \n"
               "[gw0] [100%] ERROR tests/test_cuda.py::test_d \n")
    assert dc.parse_tests(plain, Path()) == {"counts": {"passed": 1, "failed": 1},
                                             "failed": ["tests/test_cuda.py::test_b[x-1]"],
                                             "summary": "1 failed, 1 passed in 3.10s"}
    found = dc.parse_tests(workers, Path())
    assert found["counts"] == {"passed": 1, "skipped": 1, "error": 1} and found["summary"] is None
    assert found["failed"] == ["tests/test_cuda.py::test_d"]


def test_benchmark_rows_and_ratios(dc, tmp_path: Path) -> None:
    def row(name: str, seconds: float | None, note: str = "") -> dict:
        return {"n": 65536, "mechanism": name, "fwd_s": seconds, "fwd_bwd_s": seconds and 3 * seconds,
                "inference_bytes": 2**20, "training_bytes": None, "kept_bytes": None, "note": note}

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": [row("full", 0.01), row("local", 0.002), row("flex-sliding (direct)", 0.001),
                                         row("routing", 0.003), row("routing-p2", None, "failed: OOM")]}))
    found = dc.parse_bench(path)
    assert found["n"] == 65536 and found["rows"]["local"] == {"fwd_ms": 2.0, "fwd_bwd_ms": 6.0, "inference_mib": 1.0,
                                                               "training_mib": None, "note": None}
    assert found["local / flex-sliding"] == 2.0 and found["routing / local"] == 1.5
    assert "routing-p2 / local" not in found and found["rows"]["routing-p2"]["note"] == "failed: OOM"


def test_a_benchmark_stopped_before_its_json_is_read_from_its_log(dc, tmp_path: Path) -> None:
    """The rows a stopped run measured, from its ``measured ...`` lines (as bench attention prints them)."""
    output = ("attention: flex\nmeasured full at N=16384: fwd 0.74, fwd+bwd 2.41 ms (2 s)\n"
              "measured local at N=16384: fwd 0.52, fwd+bwd 1.40 ms (9 s)\n"
              "measured routing at N=16384: fwd 3.80, fwd+bwd 7.70 ms (11 s)\n"
              "measured lsh at N=16384: fwd n/a, fwd+bwd n/a ms (1 s)\n")
    found = dc.parse_bench(tmp_path / "missing.json", output)
    assert found["n"] == 16384 and found["rows"]["routing"]["fwd_bwd_ms"] == 7.7
    assert found["rows"]["lsh"]["fwd_ms"] is None and found["routing / local"] == 5.5
    with pytest.raises(FileNotFoundError):
        dc.parse_bench(tmp_path / "missing.json", "attention: flex\n")


def test_a_benchmark_cut_after_two_rows_keeps_those_two_rows(dc, tmp_path: Path) -> None:
    """A run stopped during its third row (no JSON) gives the two rows it printed, their memory and note with
    them; a JSON that cannot be read is passed over for the lines the same way."""
    output = ("attention: flex\nmeasured full at N=65536: fwd 9.62, fwd+bwd 35.07 ms, inference 64.0 MiB, "
              "training 388.0 MiB (21 s)\n"
              "measured local at N=65536: fwd 0.97, fwd+bwd 2.16 ms, inference 33.5 MiB, training n/a MiB "
              "(19 s, training not run: ~9.0 GiB estimated)\n"
              "[rank0]: W1129 torch/_inductor compiling routing's backward\n")
    found = dc.parse_bench(tmp_path / "missing.json", output)
    assert list(found["rows"]) == ["full", "local"] and found["n"] == 65536
    assert found["rows"]["full"] == {"fwd_ms": 9.62, "fwd_bwd_ms": 35.07, "inference_mib": 64.0,
                                     "training_mib": 388.0, "note": "read from the log (no JSON)"}
    assert found["rows"]["local"]["training_mib"] is None
    assert found["rows"]["local"]["note"] == "read from the log (no JSON); training not run: ~9.0 GiB estimated"
    (tmp_path / "torn.json").write_text('{"rows": [{"n": 65536, "mech')
    assert dc.parse_bench(tmp_path / "torn.json", output)["rows"] == found["rows"]


def test_the_measured_lines_bench_attention_prints_read_as_its_json(dc) -> None:
    """The line format is bench attention's own: the rows read from the lines it printed (on the notes' stream) are
    the rows it returned, to the lines' two decimals."""
    from routeformer.bench.attention import AttentionBench, run
    from routeformer.bench.measure import Echo

    notes: list[str] = []
    rows = run([64], AttentionBench(heads=1, head_dim=8, window=8, repeats=1, only=("local", "routing"), leak_n=0),
               Echo(lambda line: None, notes.append))
    found = dc.parse_measured("\n".join(notes))
    assert found["n"] == 64 and list(found["rows"]) == [r["mechanism"] for r in rows]
    for row in rows:
        read = found["rows"][row["mechanism"]]
        for key, seconds in (("fwd_ms", row["fwd_s"]), ("fwd_bwd_ms", row["fwd_bwd_s"])):
            assert (read[key] is None) == (seconds is None)
            assert seconds is None or abs(read[key] - seconds * 1e3) <= 0.005
        for key, size in (("inference_mib", row["inference_bytes"]), ("training_mib", row["training_bytes"])):
            assert (read[key] is None) == (size is None) and (size is None or abs(read[key] - size / 2**20) <= 0.05)


def test_a_step_cut_by_its_limit_keeps_the_numbers_it_printed_and_says_them(dc, tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    """A bench step that prints two rows then hangs: cut at its 3-s limit it is a timeout whose numbers are the two
    rows (not the stale JSON an earlier check left in the folder), and the check's stdout names them as it ends."""
    out = tmp_path / "check"
    out.mkdir()
    stale = out / "bench-64.json"
    stale.write_text(json.dumps({"rows": [{"n": 64, "mechanism": "stale", "fwd_s": 1.0, "fwd_bwd_s": 2.0,
                                           "inference_bytes": None, "training_bytes": None, "note": ""}]}))
    code = ("import sys, time\n"
            "print('measured full at N=64: fwd 0.50, fwd+bwd 1.50 ms, inference 1.0 MiB, training 2.0 MiB (1 s)',"
            " file=sys.stderr, flush=True)\n"
            "print('measured local at N=64: fwd 0.25, fwd+bwd 0.75 ms, inference n/a MiB, training n/a MiB (1 s)',"
            " file=sys.stderr, flush=True)\n"
            "time.sleep(60)")
    step = dc.Step("bench-64", "two rows, then a hang", _py(code), 3,
                   parse=lambda output, _: dc.parse_bench(stale, output), writes=(stale,))
    monkeypatch.setattr(dc, "plan", lambda mode, part: [step, dc.Step("after", "", _py("pass"), 60)])
    start = time.monotonic()
    assert dc.main([str(out), "--toy", "--device", "cpu"]) == 1
    assert time.monotonic() - start < 30 and not stale.exists()
    recorded = json.loads((out / "report.json").read_text())["steps"][0]
    assert recorded["status"] == "timeout" and list(recorded["numbers"]["rows"]) == ["full", "local"]
    assert recorded["numbers"]["rows"]["local"]["fwd_bwd_ms"] == 0.75 and recorded["numbers"]["n"] == 64
    assert recorded["writes"] == [str(stale)]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("device check: bench-64: timeout in ") and printed[0].endswith("(limit 3 s)")
    assert any(line.startswith("  rows | local: ") and "0.75" in line for line in printed)


def test_the_routing_part_gives_each_step_room_to_compile_within_nine_minutes(dc, tmp_path: Path) -> None:
    """On a GPU the routing part's limits add up to 530 s (10 s of the 540 left for the check's start and a cut
    step's SIGTERM grace), each step with at least what plan's docstring allows it for its compilations: the
    kernels' tests 110 s, the benchmark 120 s at 64k and 90 s at 256k, flex-cost 80 s, routing's device tests 70 s,
    the profile (on the caches bench-65536 filled) 40 s."""
    steps = {s.name: s.limit_s for s in dc.plan(dc.Mode("cuda", False, tmp_path), "routing")}
    assert sum(steps.values()) <= 530
    floors = {"versions": 20, "routing-kernels": 110, "bench-65536": 120, "bench-262144": 90, "profile": 40,
              "routing-tests": 70, "flex-cost": 80}
    assert set(steps) == set(floors) and all(steps[name] >= floor for name, floor in floors.items())


def test_a_budget_stops_the_check_and_leaves_later_steps_not_run(dc, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "check"
    steps = [dc.Step("quick", "", _py("print('VALUE 1')"), 60),
             dc.Step("slow", "", _py("import time; time.sleep(60)"), 60), dc.Step("later", "", _py("pass"), 60)]
    monkeypatch.setattr(dc, "plan", lambda mode, part: steps)
    start = time.monotonic()
    assert dc.main([str(out), "--toy", "--device", "cpu", "--budget-s", "8"]) == 1
    assert time.monotonic() - start < 30
    table = json.loads((out / "report.json").read_text())
    assert [s["status"] for s in table["steps"]] == ["pass", "timeout", "not run"]


def test_the_flex_cost_is_read_from_its_line(dc) -> None:
    output = ("| mask | ... |\nFLEXCOST " + json.dumps({"sliding": {"partial": 2.0, "full": 1.0, "fwd_ms": 0.24,
                                                                   "fwd_bwd_ms": 1.6}}) + "\n")
    assert dc.parse_flex_cost(output, Path())["sliding"]["fwd_ms"] == 0.24


def test_a_flex_cost_cut_before_its_summary_keeps_the_masks_it_measured(dc) -> None:
    """No FLEXCOST line (the step's limit came first): the FLEXROW line of each mask measured is read."""
    sliding = {"partial": 2.0, "full": 1.0, "fwd_ms": 0.24, "fwd_bwd_ms": 1.6}
    routing = {"partial": 2.45, "full": 0.0, "fwd_ms": 1.03, "fwd_bwd_ms": None}
    output = (f"| mask | ... |\nFLEXROW {json.dumps({'mask': 'sliding', **sliding})}\n| sliding | ... |\n"
              f"FLEXROW {json.dumps({'mask': 'routing', **routing})}\n")
    assert dc.parse_flex_cost(output, Path()) == {"sliding": sliding, "routing": routing}
    with pytest.raises(ValueError):
        dc.parse_flex_cost("N=512, 8 heads of 64\n", Path())


def test_progress_bars_leave_their_last_state(dc) -> None:
    assert dc.settled("a\nbar 1%\rbar 50%\rbar 100%\r    \rdone\nz\r\n") == "a\ndone\nz\n"
    assert dc.settled("bar 1%\rbar 100%\r   \r\nnext") == "bar 100%\nnext"


def test_junit_outcomes_are_counted_with_the_failed_tests_named(dc, tmp_path: Path) -> None:
    xml = tmp_path / "suite.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok"/>'
                   '<testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>'
                   '<testcase classname="tests.test_b" name="test_err"><error message="y"/></testcase>'
                   '<testcase classname="tests.test_b" name="test_skip"><skipped/></testcase></testsuite></testsuites>')
    found = dc.parse_junit(xml)
    assert found["counts"] == {"passed": 1, "failed": 2, "skipped": 1}
    assert found["failed"] == ["tests.test_a::test_bad", "tests.test_b::test_err"]


def test_the_profile_names_the_operators_of_each_row(dc) -> None:
    output = ('== local\ntable\nPROFILE {"row": "local", "ms_per_step": 2.0, "top_ms_per_step": {"a": 1.0}}\n'
              'PROFILE {"row": "routing", "ms_per_step": 9.0, "top_ms_per_step": {"scatter": 5.0}}\n')
    found = dc.parse_profile(output, Path("."))
    assert found["routing"]["top_ms_per_step"] == {"scatter": 5.0} and found["local"]["ms_per_step"] == 2.0
