"""The quality benchmarks at toy sizes: the recall table and the text table have their rows and columns, and bad
settings are refused with the reason (their numbers are the benchmark's business, not a test's)."""

from __future__ import annotations

import pytest

from helpers import banner
from routeformer.bench import recall
from routeformer.bench.measure import Echo
from routeformer.bench.recall import HEADERS, attention_config
from routeformer.cli import main
from routeformer.data import prepare
from routeformer.executors import describe_backend


def test_bench_recall_prints_a_row_per_task_and_attention(capsys) -> None:
    probed = "local+routing/separate@options.routing.probes=2@options.routing.warmup=1"
    assert main(["bench", "recall", "--tasks", "passkey", "mqar", "--attention", "full", "local", probed,
                 "--seq-len", "48", "--gap", "12", "--window", "4", "--dim", "16", "--steps", "2", "--batch", "2",
                 "--eval", "4", "--seeds", "0", "1"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert banner(captured.err) == describe_backend("auto", "cpu") and captured.err.count("attention: ") == 1
    table = [line for line in out[out.index("| task"):].splitlines() if line.startswith("|")]  # not warnings
    assert [cell.strip() for cell in table[0].split("|")[1:-1]] == HEADERS
    rows = [dict(zip(HEADERS, (cell.strip() for cell in line.split("|")[1:-1]), strict=True)) for line in table[2:]]
    # the reference: min(800, 2 // 2) steps at 48 // 4, doubled for mqar (4 facts, 2 queries and a gap of
    # 2 × (4 - 1) do not fit in 12)
    assert [(r["task"], r["attention"]) for r in rows] == [
        (t, a) for t, n in (("passkey", 12), ("mqar", 24))
        for a in (f"reference: full (curriculum 1 at {n}, seeds 0 1)", "full", "local", probed)]
    ref, full, local, routed = rows[4:]
    assert local["chance %"] == routed["chance %"] == "6.2"  # chance: 1 / 16 values
    assert len(local["seeds %"].split("/")) == 2  # one accuracy per seed, the mean beside
    assert ref["vs ref"] in ("1.00", "-")  # the reference is every row's yardstick ("-" when it scored 0)
    assert local["keys/query"] == "4.0" and local["balance"] == "-" and local["in window %"] == "-"
    assert local["head options"] == "local: window=4"
    # k = round(sqrt(48)) = 7, window 48 // (7 · 2) = 3: two probes of 3 keys, and the 7 centroids that route
    assert "routing: k=7, w=3, p=2, bias=0.01, warm-up=1, separate" in routed["head options"]
    assert float(routed["keys/query"]) == (4 + 4 + 2 * (2 * 3 + 7)) / 4
    # with two probes each diagnostic is the total and the share of each probe (a key has one cluster)
    total, shares = routed["in window %"].split(" ", 1)
    assert abs(float(total) - sum(float(x) for x in shares.strip("()").split("+"))) < 0.2
    assert 0 <= float(routed["in window %"].split()[0]) <= float(routed["in cluster %"].split()[0]) <= 100

def test_bench_recall_names_the_executor_of_each_row() -> None:
    said: list[str] = []
    recall.run(["passkey"], ["local", "local@backend='tiles'", "full"], recall.RecallSettings(seq_len=48, gap=12,
               window=4, dim=16), recall.Training(steps=1, batch=2, eval_sequences=4),
               echo=Echo(lambda *_: None, said.append))
    auto = describe_backend("auto", "cpu").removeprefix("attention: ")
    assert said == [f"attention (local, full): {auto}", "attention (local@backend='tiles'): tiles (asked for)"]


def test_bench_recall_counts_the_dense_warm_up_in_the_training_flops(monkeypatch) -> None:
    made = []
    make = recall.RecallTask.make
    monkeypatch.setattr(recall.RecallTask, "make", lambda self, b, seed: made.append((self.seq_len, b))
                        or make(self, b, seed))
    rows = recall.run(["passkey"], ["local+routing", "local+routing@options.routing.warmup=1",
                                    "local+routing@options.routing.warmup=1@options.routing.warmup_len=16", "full"],
                      recall.RecallSettings(seq_len=48, gap=12, window=4, dim=16),
                      recall.Training(steps=2, batch=2, eval_sequences=4), reference=None, echo=lambda *_: None)
    routed, warm, short, full = (r["train_flops"] for r in rows)
    assert routed < short < warm < full  # one of two steps dense: between routing all along and full attention
    # the short warm-up's step trains on 3 × 2 sequences of 16 tokens, the same tokens as 2 of 48
    assert made[6:9] == [(16, 6), (48, 2), (48, 4)]  # then the second step, then the scoring (3 calls a row)


@pytest.mark.parametrize("args, message", [
    (["--gap", "13", "--window", "8"], "gap (13) must be at least depth × (window - 1) = 14"),
    (["--tasks", "copy"], "unknown task 'copy'"),
    (["--attention", "local+routing/mixed"], "unknown routing variant 'mixed'"),
    (["--attention", "local+routing@routing_probs=2"], "'@routing_probs=2' sets no model config field"),
    (["--attention", "local+routing@routing_probes=2"], "'local+routing@routing_probes=2': '@routing_probes=2': "
                                                        "routing_probes is the old spelling of options.routing.probes; "
                                                        "write @options.routing.probes=2"),
])
def test_bench_recall_refuses_what_would_not_test_reach(args, message, capsys) -> None:
    assert main(["bench", "recall", "--steps", "1", *args]) != 0
    assert message in capsys.readouterr().err


def test_attention_rows_name_their_routing() -> None:
    assert attention_config("local+routing", 4) == {"attention": "local:2,routing:2"}
    assert attention_config("local+routing/separate", 8) == {"attention": "local:4,routing:4", "options": {
        "routing": {"shared_qk": False, "separate": True}}}
    assert attention_config("full", 4) == {"attention": "full"}
    assert attention_config("local+routing/joint@options.routing.probes=3@options.routing.gate=true", 4) == {
        "attention": "local:2,routing:2", "options": {"routing": {"shared_qk": False, "separate": False, "probes": 3,
                                                                  "gate": True}}}


def test_bench_text_trains_each_attention_on_the_same_budget(tmp_path, capsys) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("".join(f"{i}: def f(x): return x * {i}\n" for i in range(400)))
    prepare("text", tmp_path / "data", str(corpus), dataset_name="tiny")
    assert main(["bench", "text", "--attention", "local", "local+routing", "--seq-len", "32", "--window", "8",
                 "--steps", "3", "--minutes", "1", "--data", "tiny", "--data-dir", str(tmp_path / "data"),
                 "--out", str(tmp_path / "runs"), "--set", "dim=16", "--set", "depth=1", "--set", "eval_every=100",
                 "--set", "warmup_steps=1", "--set", "batch_size=2", "--set", "options.routing.probes=2",
                 "--set", "options.routing.warmup=1000", "--set", "options.routing.warmup_len=64",
                 "--set", "device=cpu"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert banner(captured.err) == describe_backend("auto", "cpu") and captured.err.count("attention: ") == 1
    # k = round(sqrt(32)) = 6 and 32 // (6 · 2 probes) = 2 keys per probe; the configuration's warm-up length (64 of
    # its 256) keeps its share of the bench's length: 8 of 32
    assert "| local " in out and "| local+routing " in out
    assert "k=6, w=2, p=2, warm-up=1000 at length 8" in out
    assert out.count("bits per byte") >= 2 and (tmp_path / "runs" / "32-local").is_dir()  # per length and row
    from routeformer.train.runs import read_run_config

    for row in ("32-local", "32-local-routing"):  # the cosine over --steps, not over the main job's decay_steps
        run = read_run_config(tmp_path / "runs" / row)
        assert run.train.max_steps == run.train.decay_steps == 3
        # nor the main job's curriculum of repeated text and token shift: the rows compare attention
        assert run.train.repeat_steps == 0 and run.model.token_shift == "none"


def test_bench_text_device_and_dtype_reach_every_row(tmp_path, capsys) -> None:
    """--device and --dtype are the rows' [train] device and precision (bfloat16 autocast here, on the CPU), and
    --set decay_steps=0 (the cosine over the time budget), repeat_steps and token_shift are kept rather than
    replaced by the bench's own."""
    from routeformer.train.runs import read_run_config

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("".join(f"{i}: def f(x): return x * {i}\n" for i in range(400)))
    prepare("text", tmp_path / "data", str(corpus), dataset_name="tiny")
    base = ["bench", "text", "--attention", "local", "--seq-len", "32", "--window", "8", "--steps", "2",
            "--minutes", "1", "--data", "tiny", "--data-dir", str(tmp_path / "data"), "--set", "dim=16",
            "--set", "depth=1", "--set", "eval_every=100", "--set", "batch_size=2"]
    assert main([*base, "--out", str(tmp_path / "bf16"), "--device", "cpu", "--dtype", "bfloat16",
                 "--set", "decay_steps=0", "--set", "repeat_steps=1", "--set", "token_shift=half"]) == 0
    assert "bits per byte" in capsys.readouterr().out
    run = read_run_config(tmp_path / "bf16" / "32-local")
    train = run.train
    assert (train.device, train.precision, train.decay_steps, train.max_steps) == ("cpu", "bfloat16", 0, 2)
    assert (train.repeat_steps, run.model.token_shift) == (1, "half")  # set by the user: kept
    # without them: the configuration's (auto, auto) and the cosine over --steps
    assert main([*base, "--out", str(tmp_path / "plain")]) == 0
    train = read_run_config(tmp_path / "plain" / "32-local").train
    assert (train.device, train.precision, train.decay_steps) == ("auto", "auto", 2)
    capsys.readouterr()
    for flag, value, key in (("--device", "cpu", "device"), ("--dtype", "float32", "precision")):
        assert main([*base, "--out", str(tmp_path / "both"), flag, value, "--set", f"{key}={value}"]) == 2
        assert f"{flag} {value} and --set {key}=... both set the rows' {key}" in capsys.readouterr().err
    assert not (tmp_path / "both").exists()


def test_bench_recall_writes_its_rows_as_json_on_the_device_it_is_given(tmp_path, capsys) -> None:
    """--json keeps the rows (each seed's accuracy, the ratio to the reference) and the settings, the device among
    them; the rows are those the table prints."""
    import json

    path = tmp_path / "recall.json"
    assert main(["bench", "recall", "--tasks", "passkey", "--attention", "local", "--seq-len", "48", "--gap", "12",
                 "--window", "4", "--dim", "16", "--steps", "2", "--batch", "2", "--eval", "4", "--seeds", "0", "1",
                 "--device", "cpu", "--json", str(path)]) == 0
    written = json.loads(path.read_text())
    assert written["suite"] == "recall" and written["settings"]["device"] == "cpu"
    assert written["settings"]["tasks"] == ["passkey"] and written["settings"]["seeds"] == [0, 1]
    assert [r["attention"] for r in written["rows"]] == ["reference: full (curriculum 1 at 12, seeds 0 1)", "local"]
    local = written["rows"][1]
    assert len(local["seeds"]) == 2 and local["accuracy"] == sum(local["seeds"]) / 2
    assert local["vs_ref"] is None or isinstance(local["vs_ref"], float)
    assert ", cpu, threads=" in capsys.readouterr().out  # the header names the device
