"""Training from the command line on a tiny data set: the run directory, exact resume, Ctrl-C, faults, evaluate and
sample, configuration rules."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import banner, executor_named, period, tiny_model_toml, tiny_text_data
from routeformer.cli import main
from routeformer.data import prepare
from routeformer.executors import describe_backend
from routeformer.executors.fused.build import build_chain
from routeformer.train import executor_line, load_run_config
from routeformer.train.config import TrainConfig, parse_override
from routeformer.train.loop import budget_warning
from routeformer.train.schedule import TimeShare, learning_rate

TINY = tiny_model_toml(depth=1) + """
[train]
device = "cpu"  # a CPU test, also on a machine with a GPU
data = "tiny"
batch_size = 4
lr = 3e-3
warmup_steps = 2
max_steps = 12
eval_every = 4
eval_tokens = 256
log_every = 2
sample_tokens = 16
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    words = "def routing(query, keys): return sorted(keys, key=lambda k: -query @ k)\n"
    data_dir = tiny_text_data(root, "".join(f"{i}: {words}" for i in range(300)))
    config = root / "tiny.toml"
    config.write_text(TINY)
    return {"root": root, "data": data_dir, "config": config}


def train(setup, out: Path, *extra: str) -> int:
    return main(["train", "--config", str(setup["config"]), "--data-dir", str(setup["data"]), "--out", str(out),
                 *extra])


def metrics(run: Path, split: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def test_a_run_directory_holds_everything(setup, capsys) -> None:
    run = setup["root"] / "run"
    assert train(setup, run) == 0
    captured = capsys.readouterr()
    out = captured.out
    # the first line on stderr names the executor the attention runs on, and why
    line = banner(captured.err)
    assert line == executor_line(load_run_config(run / "config.toml")), captured.err
    assert line.startswith(executor_named("cpu")) and line.endswith(")")
    assert captured.err.count("attention: ") == 1 and "attention: " not in out
    # a line per periodic validation on screen, and a progress bar for the final evaluation
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 4", "step 8", "step 12"], out
    assert all("train bpb" in line and "valid bpb" in line and "tok/s" in line and "elapsed" in line
               and "left" in line for line in lines)
    assert "final evaluation" in captured.err and "window" in captured.err
    assert "warning" not in out
    for name in ("config.toml", "checkpoint.pt", "model.safetensors", "config.json", "metrics.jsonl",
                 "best/model.safetensors", "best/config.json"):
        assert (run / name).is_file(), name
    assert "validation bits per byte" in out and f"run directory: {run}" in out and "sample (the prompt" in out
    body = out.split("-" * 72)[1]  # the sample: 64 bytes of the validation split, the mark, the continuation
    assert body.count("⟫") == 1 and len(body.split("⟫")[0].strip("\n").encode()) <= 64
    resolved = load_run_config(run / "config.toml")
    assert resolved.model.options["routing"].num_clusters == 3
    assert resolved.train.data == "tiny" and resolved.train.max_steps == 12
    assert [r["step"] for r in metrics(run, "valid")] == [4, 8, 12]
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["step"] == 12 and {"model", "optimizer", "scaler", "rng", "best"} <= set(state)
    assert any(k.endswith("kmeans.centroids") for k in state["model"])


def test_a_diverging_run_stops_at_the_first_non_finite_loss_and_keeps_the_last_good_state(setup, monkeypatch,
                                                                                           capsys) -> None:
    """A loss of nan (here from step 6 on, as a bf16 run on a GPU gave at a high learning rate) stops the run at
    once with exit status 1 and a message naming the step; checkpoint.pt keeps the last evaluation's state (step 4),
    finite, and the nan weights are never written."""
    import routeformer.train.loop as loop

    real = loop.Loop.step

    def diverging(self, step: int, *args) -> float:
        loss = real(self, step, *args)
        if step < 6:
            return loss
        with torch.no_grad():  # what an overflow leaves behind: weights and loss nan
            for p in self.core.parameters():
                p.fill_(float("nan"))
        return float("nan")

    monkeypatch.setattr(loop.Loop, "step", diverging)
    run = setup["root"] / "diverged"
    assert train(setup, run) == 1
    err = capsys.readouterr().err
    assert "training diverged: the loss at step 6 is nan" in err and "keeps step 4" in err, err
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["step"] == 4
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert [r["step"] for r in metrics(run, "train")] == [2, 4]


def test_weight_decay_reaches_matrices_and_embeddings_not_biases_or_norms() -> None:
    """AdamW's groups: every parameter once; decayed: two or more dimensions and not a bias, so nsa's per-head gate
    bias (heads, 3) is not, its gate weights (heads, D, 3) are."""
    from routeformer.model import TransformerConfig, TransformerLM
    from routeformer.train.loop import adamw

    options = {"local": {"window": 8}, "nsa": {"block": 4, "window": 8}}
    model = TransformerLM(TransformerConfig(vocab_size=32, dim=32, depth=1, heads=2, seq_len=32,
                                            attention="local:1,nsa:1", options=options))
    decay, rest = adamw(model, TrainConfig()).param_groups
    assert decay["weight_decay"] > 0 and rest["weight_decay"] == 0
    names = {id(p): name for name, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert len(decay["params"]) + len(rest["params"]) == len(names)
    assert any(n.endswith("gate_weight") for n in decayed) and not any(n.endswith("gate_bias") for n in decayed)
    assert "embed.weight" in decayed and not any(n.endswith("bias") or "norm" in n for n in decayed), decayed


def test_resume_matches_an_uninterrupted_run_exactly(setup) -> None:
    whole, part = setup["root"] / "whole", setup["root"] / "part"
    assert train(setup, whole) == 0
    # stops between evaluations, inside the planned 12-step schedule: a checkpoint mid-window
    assert train(setup, part, "--max-steps", "6", "--set", "decay_steps=12") == 0
    assert main(["train", "--resume", str(part), "--max-steps", "12"]) == 0
    for split in ("train", "valid"):
        a = [(r["step"], r["loss"]) for r in metrics(whole, split)]
        b = [(r["step"], r["loss"]) for r in metrics(part, split) if r["step"] not in (6,) or split == "train"]
        assert [x for x in b if x[0] != 6] == [x for x in a if x[0] != 6]
    train_a = {r["step"]: r["loss"] for r in metrics(whole, "train")}
    train_b = {r["step"]: r["loss"] for r in metrics(part, "train")}
    assert train_a == train_b  # every logged training loss, bit for bit
    wa = torch.load(whole / "checkpoint.pt", weights_only=True)["model"]
    wb = torch.load(part / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # The limit given on resume is the run's from now on: a later plain --resume (as the Ctrl-C message says)
    # continues to step 12, not to the original 6.
    assert load_run_config(part / "config.toml").train.max_steps == 12


def test_a_fresh_start_drops_the_rows_of_a_start_that_died_before_its_first_checkpoint(setup) -> None:
    run = setup["root"] / "died"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "train", "loss": 99.0}) + "\n")
    assert train(setup, run, "--max-steps", "2") == 0
    assert all(r["loss"] != 99.0 for r in metrics(run, "train")) and metrics(run, "train")[0]["step"] == 2


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 13-27 s a worker): CI's slow line runs it
def test_the_banner_says_tiles_and_why_when_the_fused_kernel_is_switched_off(setup, tmp_path) -> None:
    """ROUTEFORMER_FUSED=0 (read once per process: a process of its own): train's first line says the tiles
    executor runs, and why; evaluate and sample on that run say the same."""
    run = tmp_path / "tiles"
    cmd = [sys.executable, "-m", "routeformer", "train", "--config", str(setup["config"]), "--data-dir",
           str(setup["data"]), "--out", str(run), "--max-steps", "2", "--set", "eval_every=2",
           "--set", "device=cpu"]
    env = {**os.environ, "ROUTEFORMER_FUSED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    why = f"attention: tiles (fused kernel unavailable: {build_chain()[0]}: ROUTEFORMER_FUSED=0)"
    assert banner(done.stderr) == why, done.stderr
    assert "attention: " not in done.stdout
    for command in (["evaluate", str(run), "--device", "cpu"],
                    ["sample", str(run), "--prompt", "def", "--tokens", "2", "--device", "cpu"]):
        done = subprocess.run([sys.executable, "-m", "routeformer", *command], capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == 0 and banner(done.stderr) == why, done.stderr


def test_ctrl_c_outside_training_is_one_line(monkeypatch, capsys) -> None:
    from routeformer import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "evaluate", interrupted)
    assert main(["evaluate", "somewhere"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "routeformer: evaluate interrupted" and "Traceback" not in err


def _spawn(setup, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "routeformer", "train", "--config", str(setup["config"]), "--data-dir",
           str(setup["data"]), "--out", str(out), "--max-steps", "100000", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoint(run: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    start = time.time()
    while not (run / "checkpoint.pt").is_file():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - start < timeout
        time.sleep(0.2)


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 13-27 s a worker): CI's slow line runs it
def test_ctrl_c_saves_and_exits_cleanly_then_resumes(setup) -> None:
    run = setup["root"] / "interrupted"
    proc = _spawn(setup, run)
    _wait_for_checkpoint(run, proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted at step" in err and f"--resume {run}" in err
    step = torch.load(run / "checkpoint.pt", weights_only=True)["step"]
    assert f"interrupted at step {step};" in err
    assert main(["train", "--resume", str(run), "--max-steps", str(step + 2)]) == 0
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == step + 2


def test_a_killed_run_leaves_its_previous_checkpoint(setup) -> None:
    run = setup["root"] / "killed"
    proc = _spawn(setup, run, "--set", "eval_every=1")  # checkpoints written all the time: kill lands mid-write
    _wait_for_checkpoint(run, proc)
    time.sleep(1.3)
    proc.kill()
    proc.communicate(timeout=60)
    state = torch.load(run / "checkpoint.pt", weights_only=True)  # intact, whatever moment the kill hit
    assert state["step"] >= 1
    assert main(["train", "--resume", str(run), "--max-steps", str(state["step"] + 1)]) == 0


def test_evaluate_and_sample(setup, capsys) -> None:
    run = setup["root"] / "run"
    if not (run / "checkpoint.pt").is_file():
        assert train(setup, run) == 0
    capsys.readouterr()
    assert main(["evaluate", str(run), "--split", "test", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "test split" in captured.err and "window" in captured.err  # its progress bar
    assert banner(captured.err) == load_run_config(run / "config.toml").model.describe_executor("cpu")
    assert banner(captured.err).startswith(executor_named("cpu")) and "attention: " not in out
    assert "bits per byte" in out and "test split of tiny" in out and "non-overlapping windows of 32 tokens" in out
    assert main(["evaluate", str(run), "--stride", "8", "--checkpoint", "last", "--device", "cpu"]) == 0
    assert "scoring the last 8 of each (at least 24 tokens of context)" in capsys.readouterr().out
    assert main(["sample", str(run), "--prompt", "def routing(", "--tokens", "20", "--seed", "1", "--device",
                 "cpu"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.startswith("def routing(") and len(out) > len("def routing(")
    assert banner(captured.err) == describe_backend("auto", "cpu") and banner(captured.err).startswith(executor_named())
    assert main(["sample", str(run), "--prompt", "def routing(", "--tokens", "20", "--seed", "1", "--device",
                 "cpu"]) == 0
    assert capsys.readouterr().out == out  # seeded: the same text
    # a prompt that is not UTF-8 (argv bytes 0xff 0xfe arrive as surrogates): its bytes are the prompt
    assert main(["sample", str(run), "--prompt", "def \udcff\udcfe(", "--tokens", "4", "--seed", "1", "--device",
                 "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def \ufffd\ufffd(")


def test_the_final_score_takes_eval_overlap_as_evaluate_takes_stride(setup, capsys, tmp_path) -> None:
    """eval_overlap lays the whole split's windows of the run's own final score: 0.75 of seq_len 32 is a stride of
    8, the same number `evaluate --stride 8` gives on the run's last weights, different from the non-overlapping
    one, and the line says how it was laid."""
    run = tmp_path / "strided"
    assert train(setup, run, "--set", "eval_overlap=0.75", "--set", "lr=1e-2") == 0
    out = capsys.readouterr().out
    assert "whole split in windows of 32 tokens every 8, scoring the last 8 of each" in out
    final = metrics(run, "valid_full")[-1]
    assert final["context"] == ("windows of 32 tokens every 8, scoring the last 8 of each (at least 24 tokens of "
                                "context)")
    scores = {}
    for stride in ("8", "32"):
        assert main(["evaluate", str(run), "--stride", stride, "--checkpoint", "last", "--device", "cpu"]) == 0
        scores[stride] = float(capsys.readouterr().out.split(": ")[1].split()[0])
    assert scores["8"] == pytest.approx(final["value"], abs=1e-4) and abs(scores["8"] - scores["32"]) > 1e-3


def test_an_overlap_s_stride_leaves_at_least_its_share_of_context() -> None:
    """The stride rounds down: every scored prediction keeps overlap · seq_len tokens of context or more (a
    stride rounded to the nearest would give 10 · 0.25 = 2.5 only 2), up to seq_len - 1 (a stride of 1)."""
    from routeformer.train.config import overlap_stride

    assert [overlap_stride(10, f) for f in (0.0, 0.25, 0.5, 0.95)] == [None, 7, 5, 1]
    assert overlap_stride(256, 0.5) == 128 and overlap_stride(32, 0.75) == 8


def test_an_image_model_refuses_an_overlap_and_takes_none() -> None:
    """An image model's windows must each be one whole image: an overlap (whose stride would cut images) is an error
    naming the field, no overlap is accepted."""
    from routeformer import TransformerConfig
    from routeformer.train.config import RunConfig

    image = TransformerConfig(vocab_size=256, dim=32, depth=1, heads=2, seq_len=32, attention="local:2",
                              options={"local": {"window": 8}}, positions="factorized", image_shape=[2, 4, 4])
    with pytest.raises(ValueError, match=r"eval_overlap 0.5's stride 16: this model's positions are an image's"):
        RunConfig(image, TrainConfig(eval_overlap=0.5))
    assert RunConfig(image, TrainConfig(eval_overlap=0.0)).train.eval_overlap == 0.0


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("routeformer: error: ") and "Traceback" not in err
    return err


def test_schedule_and_budget_warnings(setup, capsys, tmp_path) -> None:
    """Said once, at the start (warm-up) or after a few steps (budget), and the run goes on."""
    assert train(setup, tmp_path / "w", "--set", "warmup_steps=12") == 0
    out = capsys.readouterr().out
    assert out.count("warning: warmup_steps (12) >= max_steps (12)") == 1
    cut = budget_warning(TrainConfig(max_steps=1000, max_minutes=1.0), 10, 0.5, 55.0)
    assert cut is not None and "near step 120 of max_steps 1,000" in cut
    assert budget_warning(TrainConfig(max_steps=100, max_minutes=1.0), 10, 0.5, 55.0) is None
    assert budget_warning(TrainConfig(max_steps=100), 10, 0.5, float("inf")) is None


def test_a_slow_first_step_does_not_predict_the_budget(setup, capsys, tmp_path, monkeypatch) -> None:
    """The first step's one-time costs (compiling the fused kernels from an empty cache) are left out of the
    estimate that warns about the time budget: averaged in, this 4-second first step would predict 40 steps of
    ~0.4 s, past the 12-second budget."""
    from routeformer.train.loop import Loop

    step, calls = Loop.step, []

    def slow_first(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(4.0)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Loop, "step", slow_first)
    assert train(setup, tmp_path / "r", "--max-steps", "40", "--max-minutes", "0.2") == 0
    out = capsys.readouterr().out
    assert "the time budget (0.2 min) stops the run" not in out
    assert metrics(tmp_path / "r", "train")[-1]["step"] == 40  # and the budget did not stop it


def test_bad_inputs_are_one_line_errors(setup, capsys, tmp_path) -> None:
    cfg, data = str(setup["config"]), str(setup["data"])
    base = ["train", "--config", cfg, "--data-dir", data, "--out", str(tmp_path / "r")]
    assert "fsdp shards the model across the processes of torchrun" in _error(capsys, base + ["--fsdp"])
    assert "--only: unknown mechanism(s) 'typo'; choices: full, local" in _error(
        capsys, ["bench", "attention", "--n", "64", "--only", "typo", "--device", "cpu"])
    assert "dropout must be in [0, 1)" in _error(capsys, base + ["--set", "dropout=2"])
    assert "unknown key; valid keys: activation" in _error(capsys, base + ["--set", "dimension=3"])
    assert "seq_len (4096) + 1 is longer than the valid split" in _error(capsys, base + [
        "--set", "seq_len=4096", "--set", "options.local.window=32", "--set", "rel_clip=32"])
    assert "--set window: window is the old spelling of options.local.window / options.longformer.window; write " \
           "--set options.local.window=32 / --set options.longformer.window=32" in _error(
               capsys, base + ["--set", "window=32"])
    assert "routeformer prepare enwik8" in _error(capsys, base + ["--data", "enwik8"])
    assert not (tmp_path / "r").exists()  # a start that fails on its data leaves no run directory
    assert "device must be auto, cpu, cuda or cuda:N, got 'foo'" in _error(capsys, base + ["--set", "device=foo"])
    if not torch.cuda.is_available():
        assert "this PyTorch sees no CUDA device" in _error(capsys, base + ["--set", "device=cuda"])
    assert "sample_tokens must be a non-negative integer" in _error(capsys, base + ["--set", "sample_tokens=-3"])
    assert "min_lr (0.1) must not exceed lr" in _error(capsys, base + ["--set", "min_lr=0.1"])
    assert "eval_overlap must be a fraction in [0, 1), got 1" in _error(capsys, base + ["--set", "eval_overlap=1"])
    assert "repeat_share must be a fraction in (0, 1], got 0" in _error(capsys, base + ["--set", "repeat_share=0"])
    assert "repeat_steps must be a non-negative integer, got -1" in _error(capsys,
                                                                          base + ["--set", "repeat_steps=-1"])
    assert "a length warm-up needs both short_steps and short_len (or neither), got short_steps=3 and short_len=0" \
        in _error(capsys, base + ["--set", "short_steps=3"])
    assert "short_len (5) must be shorter than seq_len (32) and divide it" in _error(
        capsys, base + ["--set", "short_steps=3", "--set", "short_len=5"])
    assert "factorized positions of image_shape [2, 4, 4] need seq_len = 32 and data in samples of 32" in _error(
        capsys, base + ["--set", "positions=factorized", "--set", "image_shape=[2, 4, 4]"])  # text, not images
    assert "no such file, and not a shipped configuration" in _error(capsys, ["train", "--config", "nope"])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert f"cannot write to {blocker / 'd'}" in _error(capsys, ["prepare", "stdlib", "--data-dir",
                                                                 str(blocker / "d")])

    run = setup["root"] / "faults"
    assert train(setup, run, "--max-steps", "4") == 0
    capsys.readouterr()
    assert "already holds a run" in _error(capsys, ["train", "--config", cfg, "--data-dir", data, "--out", str(run)])
    assert "accepts --max-steps and --max-minutes, not --set" in _error(
        capsys, ["train", "--resume", str(run), "--set", "lr=1"])
    if not torch.cuda.is_available():
        assert "this PyTorch sees no CUDA device" in _error(capsys, ["evaluate", str(run), "--device", "cuda"])

    weights = run / "model.safetensors"
    saved = weights.read_bytes()
    weights.write_bytes(saved[:100])
    assert f"{weights} cannot be read as safetensors" in _error(capsys, ["evaluate", str(run), "--checkpoint",
                                                                         "last", "--device", "cpu"])
    weights.write_bytes(saved)
    ckpt = run / "checkpoint.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    assert f"{ckpt} cannot be read (truncated or corrupt?)" in _error(capsys, ["train", "--resume", str(run)])

    words = tmp_path / "words.zip"  # the same name, now a word-level data set: wrong data for the checkpoint
    import zipfile
    with zipfile.ZipFile(words, "w") as z:
        for split in ("train", "valid", "test"):
            z.writestr(f"wikitext-103/wiki.{split}.tokens", "a b c\n" * 20)
    other = tmp_path / "otherdata"
    prepare("wikitext103", other, str(words), dataset_name="tiny")
    assert "wrong data for this checkpoint" in _error(capsys, ["evaluate", str(run), "--data-dir", str(other),
                                                                     "--device", "cpu"])


@pytest.mark.parametrize("item, want", [
    ("lr=3e-4", ("train", "lr", 3e-4)), ("dim=64", ("model", "dim", 64)), ("checkpointing=true", ("model",
     "checkpointing", True)), ("attention=local:2,routing:2", ("model", "attention", "local:2,routing:2")),
    ('attention="full"', ("model", "attention", "full")),
    ("model.options.longformer.dilation=[1, 2]", ("model", "options.longformer.dilation", [1, 2])),
    ("train.data=enwik8", ("train", "data", "enwik8")),
    ("options.routing.window=32", ("model", "options.routing.window", 32)),
    ("model.options.strided.stride=8", ("model", "options.strided.stride", 8)),
])
def test_set_overrides_are_read_as_toml(item: str, want) -> None:
    assert parse_override(item) == want


@pytest.mark.parametrize("item, fragment", [
    ("lr", "expected KEY=VALUE"), ("model.lr=1", "unknown key"),
    ("nothing=1", "unknown key; valid keys: activation, attention"),
    ("options.routing.windw=3", r"options.routing has no field 'windw'; fields: num_clusters, window"),
    ("options.sparse.window=3", r"a kind's option is options.<section>.<field>, sections: full, local, routing"),
    ("options.routing=3", r"a kind's option is options.<section>.<field>"),
    ("routing_window=24", r"--set routing_window: routing_window is the old spelling of options.routing.window; "
                          r"write --set options.routing.window=24\. The flat names are read only from saved run"),
    ("model.window=64", r"--set model.window: window is the old spelling of options.local.window / "
                        r"options.longformer.window; write --set options.local.window=64 / --set "
                        r"options.longformer.window=64 \(it also set rel_clip when rel_clip was not given"),
    ("model.stride=8", r"stride is the old spelling of options.strided.stride; write --set "
                       r"options.strided.stride=8 \(it also set grid_width"),
])
def test_bad_overrides(item: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_override(item)


def test_a_later_setting_wins_and_the_resolved_file_reads_back(tmp_path) -> None:
    # the shipped default pins [model.options.routing] window = 16: a --set overrides it, the later of two wins
    assert load_run_config(None, ["options.routing.window=24"]).model.options["routing"].window == 24
    config = load_run_config(None, ["options.routing.window=24", "options.routing.window=20"]).model
    assert config.options["routing"].window == 20
    config = load_run_config(None, ["options.local.window=64", "rel_clip=64", "options.lsh.rounds=4"]).model
    assert config.options["local"].window == 64 and config.rel_clip == 64 and config.options["lsh"].rounds == 4
    with pytest.raises(ValueError, match="--set routing_window: routing_window is the old spelling of "
                                         "options.routing.window"):  # the flat spelling is refused, not merged
        load_run_config(None, ["routing_window=24", "options.routing.window=20"])
    path = tmp_path / "resolved.toml"
    run = load_run_config(None, ["options.routing.warmup=5", "options.routing.warmup_len=64"])
    path.write_text(run.to_toml())
    assert load_run_config(path).model == run.model


def test_a_config_file_in_the_old_flat_spelling_is_refused_with_the_new_one(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[model]\nattention = \"local:2,routing:2\"\nwindow = 64\nnum_clusters = 8\n")
    with pytest.raises(ValueError, match=rf"{path}: \[model\] window is the old spelling of options.local.window / "
                                         r"options.longformer.window; write \[model.options.local\] window / "
                                         r"\[model.options.longformer\] window \(it also set rel_clip"):
        load_run_config(path)
    path.write_text("[model]\nnum_clusters = 8\n\n[model.options.local]\nwindow = 64\n")
    with pytest.raises(ValueError, match=r"\[model\] num_clusters is the old spelling of options.routing.num_clusters; "
                                         r"write \[model.options.routing\] num_clusters\. The flat names are read "
                                         r"only from saved run files"):
        load_run_config(path)
    path.write_text("[model]\nrel_clip = 64\n\n[model.options.local]\nwindow = 64\n\n"
                    "[model.options.routing]\nnum_clusters = 8\n")  # the same settings, spelled today
    config = load_run_config(path).model
    assert (config.options["local"].window, config.rel_clip, config.options["routing"].num_clusters) == (64, 64, 8)


def test_config_files_reject_unknown_keys(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[model]\ndimm = 3\n")
    with pytest.raises(ValueError, match=r"unknown \[model\] keys \['dimm'\]; valid keys: activation, attention"):
        load_run_config(path)
    path.write_text("[optimizer]\nlr = 3\n")
    with pytest.raises(ValueError, match="unknown top-level keys"):
        load_run_config(path)


@pytest.mark.parametrize("name", ["default", "enwik8", "wikitext103", "imagenet64"])
def test_shipped_configurations_are_valid(name: str) -> None:
    run = load_run_config(name)
    assert run.model.attention.startswith("local:") and "routing" in run.model.attention


def test_learning_rate_schedules() -> None:
    from routeformer.train import TrainConfig

    cos = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110, schedule="cosine")
    assert learning_rate(5, cos) == pytest.approx(0.5) and learning_rate(10, cos) == pytest.approx(1.0)
    assert learning_rate(60, cos) == pytest.approx(0.55) and learning_rate(110, cos) == pytest.approx(0.1)
    planned = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=60, decay_steps=110, schedule="cosine")
    assert learning_rate(60, planned) == pytest.approx(0.55)  # half-way through the planned decay, not at its end
    inv = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=100, schedule="inverse_sqrt")
    assert learning_rate(400, inv) == pytest.approx(0.5)
    # the decay is at whichever share is further: the steps' or the time budget's
    assert learning_rate(20, cos, time_share=0.5) == pytest.approx(0.55)
    assert learning_rate(60, cos, time_share=0.1) == pytest.approx(0.55)
    assert learning_rate(5, cos, time_share=0.9) == pytest.approx(0.5)  # the warm-up is in steps


def test_the_time_share_of_the_decay() -> None:
    from routeformer.train import TrainConfig

    cos = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110, schedule="cosine", max_minutes=1.0)
    share = TimeShare(cos, 100.0)
    assert share.active and share.at(10, 30.0) == 0.0  # still warming up
    assert share.at(11, 20.0) == 0.0  # the decay's time starts with the first step after the warm-up
    assert share.at(12, 60.0) == pytest.approx(0.5) and share.at(13, 100.0) == 1.0 and share.at(14, 130.0) == 1.0
    resumed = TimeShare(cos, 100.0, start=0.4)  # a resumed run decays the rest over its own budget
    assert resumed.at(11, 0.0) == pytest.approx(0.4) and resumed.at(12, 50.0) == pytest.approx(0.7)
    for other in (TimeShare(cos, float("inf")), TimeShare(replace(cos, decay_steps=200), 100.0),
                  TimeShare(replace(cos, schedule="inverse_sqrt"), 100.0)):
        assert not other.active and other.at(50, 90.0) == 0.0


def test_a_run_its_time_budget_stops_still_anneals(setup, tmp_path) -> None:
    run = tmp_path / "timed"
    assert train(setup, run, "--max-steps", "100000", "--max-minutes", "0.05", "--set", "log_every=1",
                 "--set", "eval_every=100000", "--set", "min_lr=1e-4") == 0
    rows = metrics(run, "train")
    lrs = [r["lr"] for r in rows if r["step"] > 2]  # after the 2-step warm-up
    assert len(lrs) > 20, "too few steps to see the schedule"
    assert lrs[0] > 0.9 * 3e-3 and all(b <= a for a, b in zip(lrs, lrs[1:], strict=False))
    # 3 seconds of 100,000 planned steps: by steps alone the rate would barely have moved
    assert lrs[-1] < 1e-4 + 0.02 * (3e-3 - 1e-4), lrs[-5:]


def test_main_job_defaults_prepare_stdlib_on_first_use(tmp_path, capsys, monkeypatch) -> None:
    from routeformer.train.evaluation import Validator

    monkeypatch.setenv("ROUTEFORMER_DATA", str(tmp_path / "data"))
    # what is tested is the preparation: the final score on stdlib's whole validation split (1.57M bytes, a minute
    # here even for this model) is replaced by the periodic estimate
    monkeypatch.setattr(Validator, "whole_split", Validator.estimate)
    assert main(["train", "--max-steps", "1", "--set", "dim=32", "--set", "depth=1", "--set", "heads=2", "--set",
                 "attention=local:1,routing:1", "--set", "seq_len=64", "--set", "options.local.window=16",
                 "--set", "rel_clip=16", "--set", "batch_size=2", "--set", "device=cpu",
                 "--set", "sample_tokens=4", "--set", "eval_tokens=64", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "preparing the stdlib data set" in out and (tmp_path / "data" / "stdlib" / "meta.json").is_file()


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_and_argument_is_explained() -> None:
    from routeformer.cli import build_parser

    for parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help"
            default = action.default
            if action.option_strings and default not in (None, False, argparse.SUPPRESS, []):
                shown = parser._get_formatter()._get_help_string(action)
                assert "default" in shown, f"{parser.prog}: {action.option_strings[0]} does not state its default"
        if parser.prog != "routeformer":
            assert parser.description, f"{parser.prog} has no description"


def test_version(capsys) -> None:
    from routeformer import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"routeformer {__version__}"


def recorded_training_inputs(monkeypatch) -> list[torch.Tensor]:
    """The token inputs of every training forward from now on (a copy of each), in order."""
    from routeformer.model import TransformerLM

    seen: list[torch.Tensor] = []
    forward = TransformerLM.forward

    def recording(self, tokens, *args, **kwargs):
        if self.training:
            seen.append(tokens.clone())
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(TransformerLM, "forward", recording)
    return seen


def test_a_warm_up_at_a_shorter_length_trains_on_cut_sequences(setup, monkeypatch) -> None:
    """routing_warmup_len: while routing's warm-up lasts, the trainer cuts each batch into shorter sequences (the
    same tokens); then it trains at seq_len."""
    seen = recorded_training_inputs(monkeypatch)
    run = setup["root"] / "short-warm-up"
    assert train(setup, run, "--set", "options.routing.warmup=3", "--set", "options.routing.warmup_len=8",
                 "--max-steps", "5") == 0
    # batch 4 of 32 tokens = 16 sequences of 8 during the warm-up
    assert [tuple(t.shape) for t in seen] == [(16, 8)] * 3 + [(4, 32)] * 2


def test_a_length_warm_up_trains_short_rows_first_with_the_repeats_drawn_within_them(setup, monkeypatch,
                                                                                     capsys) -> None:
    """short_steps / short_len: the first steps train on each row cut into rows of short_len (the same tokens), and
    a curriculum's repeats are drawn within the short rows (periods in [short_len / 8, short_len / 2]); then rows
    of seq_len with repeats drawn within them (periods up to seq_len / 2); the banner names both."""
    seen = recorded_training_inputs(monkeypatch)
    run = setup["root"] / "short-rows-first"
    assert train(setup, run, "--set", "short_steps=3", "--set", "short_len=8", "--set", "repeat_steps=5",
                 "--set", "repeat_share=1", "--max-steps", "6") == 0
    assert "batch 4, rows of 8 over the first 3 steps, 100% of rows repeated text over the first 5 steps" \
        in capsys.readouterr().out
    assert [tuple(t.shape) for t in seen] == [(16, 8)] * 3 + [(4, 32)] * 3
    assert all(1 <= (period(row, range(1, 8)) or 0) <= 4 for batch in seen[:3] for row in batch)
    long_periods = [period(row, range(1, 32)) or 0 for batch in seen[3:5] for row in batch]
    assert all(4 <= p <= 16 for p in long_periods) and max(long_periods) > 8  # beyond what a short row holds
    assert all(period(row, range(1, 17)) is None for row in seen[5])  # after the curriculum: the data's rows


def test_a_curriculum_of_repeats_feeds_repeated_rows_to_its_first_steps_only(setup, tmp_path, monkeypatch,
                                                                            capsys) -> None:
    """repeat_steps / repeat_share from the command line: the model trains on rows that are their first L tokens
    over and over (L in [seq_len / 8, seq_len / 2]) in those steps, on the data's rows after them; the banner names
    the curriculum, the run saves it and a resumed run keeps it."""
    seen = recorded_training_inputs(monkeypatch)
    run = tmp_path / "taught"
    assert train(setup, run, "--set", "repeat_steps=3", "--set", "repeat_share=1", "--max-steps", "5") == 0
    assert "batch 4, 100% of rows repeated text over the first 3 steps," in capsys.readouterr().out
    n = seen[0].shape[1]  # seq_len: the inputs, one token shorter than a row
    assert len(seen) == 5
    assert all(n // 8 <= (period(row, range(1, n)) or 0) <= n // 2 for batch in seen[:3] for row in batch)
    assert all(period(row, range(1, n // 2 + 1)) is None for batch in seen[3:] for row in batch)
    assert "repeat_steps = 3" in (run / "config.toml").read_text()
    assert main(["train", "--resume", str(run), "--max-steps", "6"]) == 0
    assert "100% of rows repeated text over the first 3 steps" in capsys.readouterr().out


def test_a_token_shift_set_on_the_command_line_is_named_saved_and_resumed(setup, tmp_path, capsys) -> None:
    run = tmp_path / "shifted"
    assert train(setup, run, "--set", "token_shift=learned", "--max-steps", "4") == 0
    assert "attention local:1,routing:1, token shift learned)" in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["token_shift"] == "learned"
    model = torch.load(run / "checkpoint.pt", weights_only=False)["model"]
    mix = [v for k, v in model.items() if k.endswith("attention.shift_mix")]
    assert len(mix) == 1 and mix[0].abs().sum() > 0  # trained: no longer the zeros it starts at
    assert main(["train", "--resume", str(run), "--max-steps", "8"]) == 0
    assert metrics(run, "train")[-1]["step"] == 8


def _letters_data(root: Path) -> Path:
    """A data set 'letters' of 12 files, file i holding one letter 40 to 95 times: its documents show in the
    tokens themselves (a new document exactly where the letter changes)."""
    from routeformer.data import prepare

    folder = root / "letters"
    folder.mkdir(exist_ok=True)
    for i in range(12):
        (folder / f"{i:02d}.txt").write_text(chr(65 + i) * (40 + 5 * i))
    prepare("text", root / "letters-data", str(folder), dataset_name="letters")
    return root / "letters-data"


def _training_forwards(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every training forward's (tokens, documents) from now on (cloned), as the model receives them."""
    from routeformer.model import TransformerLM

    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    forward = TransformerLM.forward

    def recording(self, tokens, *args, documents=None, **kwargs):
        if self.training:
            seen.append((tokens.clone(), None if documents is None else documents.clone()))
        return forward(self, tokens, *args, documents=documents, **kwargs)

    monkeypatch.setattr(TransformerLM, "forward", recording)
    return seen


def _train_packed(setup, pack: str) -> tuple[Path, Path]:
    """Four steps on the letters (one file per letter) with ``pack``: (the data folder, the run directory)."""
    data = _letters_data(setup["root"])
    run = setup["root"] / f"packed-{pack}"
    assert main(["train", "--config", str(setup["config"]), "--data-dir", str(data), "--out", str(run),
                 "--set", "data=letters", "--set", f"pack={pack}", "--set", "options.routing.probes=1",
                 "--max-steps", "4"]) == 0
    return data, run


def test_pack_boundaries_trains_and_scores_each_file_apart(setup, monkeypatch, capsys) -> None:
    """pack = "boundaries": every training row carries its documents' ids, which change exactly where a file
    starts; the final score says it scored each document from its own start."""
    seen = _training_forwards(monkeypatch)
    data, run = _train_packed(setup, "boundaries")
    out = capsys.readouterr().out
    assert "documents apart (no context across a file's boundary)" in out
    assert "each document from its own start" in out
    assert len(seen) == 4
    for tokens, documents in seen:
        assert documents is not None and documents.shape == tokens.shape
        new_letter = tokens[:, 1:] != tokens[:, :-1]
        assert torch.equal(documents.diff(dim=1), new_letter.long())  # a new document exactly at a new file
    assert main(["evaluate", str(run), "--data-dir", str(data)]) == 0  # as the run trained: documents apart
    apart = capsys.readouterr().out
    assert "each document from its own start" in apart
    assert main(["evaluate", str(run), "--data-dir", str(data), "--pack", "none"]) == 0  # the split as one text
    whole = capsys.readouterr().out
    assert "each document" not in whole and "context: non-overlapping windows of" in whole


def test_pack_documents_trains_on_whole_documents_packed_first_fit_the_loss_within_each(setup, monkeypatch,
                                                                                       capsys) -> None:
    """pack = "documents": rows are whole files (cut into rows of seq_len + 1 where longer) packed first-fit and
    padded; a prediction counts only within one file (the loss ignores padding and every file's end); evaluation
    scores each document from its own start. The letters' files are one letter each, padding 0."""
    import torch.nn.functional as F

    seen = _training_forwards(monkeypatch)
    targets: list[torch.Tensor] = []
    cross_entropy = F.cross_entropy

    def scoring(logits, target, *args, **kwargs):
        if torch.is_grad_enabled():
            targets.append(target.clone())
        return cross_entropy(logits, target, *args, **kwargs)

    monkeypatch.setattr(F, "cross_entropy", scoring)
    data, run = _train_packed(setup, "documents")
    out = capsys.readouterr().out
    assert "whole documents packed first-fit into" in out and "each document from its own start" in out
    assert len(seen) == len(targets) == 4
    padded = 0
    for (tokens, documents), target in zip(seen, targets, strict=True):
        target = target.reshape(tokens.shape)
        for row, ids, wanted in zip(tokens.tolist(), documents.tolist(), target.tolist(), strict=True):
            for d in set(ids):  # a document is one letter, or padding
                assert len({t for t, i in zip(row, ids, strict=True) if i == d}) == 1
            for j in range(len(row) - 1):
                within = ids[j] == ids[j + 1] and row[j] != 0
                assert (wanted[j] != -100) == within and (not within or wanted[j] == row[j + 1])
            padded += row.count(0)
    assert padded > 0  # some rows were padded: the letters' files are 40-95 bytes, rows 33
    assert main(["evaluate", str(run), "--data-dir", str(data)]) == 0
    assert "each document from its own start" in capsys.readouterr().out


def test_pack_refuses_data_without_starts_heads_that_cannot_honour_them_and_unknown_values(setup, capsys) -> None:
    data = _letters_data(setup["root"])
    meta = json.loads((data / "letters" / "meta.json").read_text())
    meta.pop("starts")
    old = setup["root"] / "old-data"
    shutil.copytree(data, old, dirs_exist_ok=True)
    (old / "letters" / "meta.json").write_text(json.dumps(meta))
    args = ["train", "--config", str(setup["config"]), "--out", str(setup["root"] / "refused"), "--set",
            "data=letters", "--set", "pack=boundaries"]
    assert main([*args, "--data-dir", str(old), "--set", "options.routing.probes=1"]) != 0
    assert "pack = 'boundaries' needs the data set's document starts, and 'letters' was prepared without them" \
        in capsys.readouterr().err
    # every shipped kind honours documents; a user's kind that says it does not is refused before training
    import dataclasses

    from routeformer.attention.registry import get_kind, register_kind, unregister_kind
    register_kind(dataclasses.replace(get_kind("local"), name="undocumented", documents=False))
    try:
        assert main([*args, "--data-dir", str(data), "--set", "attention=local:1,undocumented:1",
                     "--set", "options.undocumented.window=8"]) != 0
    finally:
        unregister_kind("undocumented")
    assert "pack = 'boundaries': undocumented heads (with these options) do not honour packed documents yet" \
        in capsys.readouterr().err
    assert main([*args[:-1], "pack=files", "--data-dir", str(data)]) != 0
    assert "pack must be one of none, boundaries, documents, got 'files'" in capsys.readouterr().err
