"""``compile`` of ``routeformer train``: "auto" compiles a long CPU run after its first steps, is eager elsewhere and
says why where it cannot compile; a compile error under "auto" falls back to eager once, under true it is raised; a
compiled run resumes bit for bit (slow: inductor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import tiny_model_toml, tiny_text_data
from routeformer.cli import main
from routeformer.train import parallel
from routeformer.train.config import TrainConfig
from routeformer.train.distributed import Processes
from routeformer.train.parallel import Parallelism, TrainingForward, compile_choice

CPU = Processes(0, 1, 0, torch.device("cpu"))


@pytest.mark.parametrize("value", ["yes", 1, None, "true"])
def test_compile_is_true_false_or_auto(value) -> None:
    with pytest.raises(ValueError, match='compile must be true, false or "auto"'):
        TrainConfig(compile=value)


def test_auto_is_eager_off_one_cpu_process_and_explicit_values_hold(monkeypatch) -> None:
    monkeypatch.setattr(parallel, "_no_inductor_compiler", lambda: None)
    assert compile_choice(TrainConfig(), CPU) == ("auto", None)
    assert compile_choice(TrainConfig(), Processes(0, 1, 0, torch.device("cuda", 0))) == ("off", None)
    assert compile_choice(TrainConfig(), Processes(1, 2, 1, torch.device("cpu"), launched=True)) == ("off", None)
    assert compile_choice(TrainConfig(compile=True), Processes(0, 1, 0, torch.device("cuda", 0))) == ("on", None)
    assert compile_choice(TrainConfig(compile=False), CPU) == ("off", None)
    monkeypatch.setattr(parallel, "_no_inductor_compiler", lambda: "torch.compile finds no C++ compiler ('/x')")
    mode, note = compile_choice(TrainConfig(), CPU)
    assert mode == "off" and note.startswith("model: eager (torch.compile finds no C++ compiler ('/x')")
    assert compile_choice(TrainConfig(compile=True), CPU) == ("on", None)  # asked for: its error will say why


def test_no_compiler_for_inductor_is_found_and_named(tmp_path) -> None:
    code = "from routeformer.train.parallel import _no_inductor_compiler as f; print(f())"
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no C++ compiler" in out.stdout and "no-such-c++" in out.stdout, out.stdout


@pytest.mark.slow  # three processes that import inductor (15 s); CI's slow line runs it beside the cache test
def test_the_pin_keeps_inductors_choice_and_names_its_width() -> None:
    code = ("from torch._inductor import config, cpu_vec_isa as c; a = c.pick_vec_isa(); "
            "from routeformer.train.parallel import pin_inductor_isa as pin; pin(); b = c.pick_vec_isa(); "
            "print(str(a) == str(b), config.cpp.simdlen == a.bit_width())")
    for capability in ("default", "avx2", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.split() == ["True", "True"], (capability, out.stdout, out.stderr[-2000:])


class Recorder(nn.Module):
    """A module that records which form ran: eager calls append "eager"."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("eager")
        return x + 1


def test_auto_decides_once_on_the_eager_time_left() -> None:
    calls: list[str] = []
    said: list[str] = []
    short = TrainingForward(Recorder(calls), "auto", auto=True)
    assert short.undecided and not short.decide(11, parallel.AUTO_COMPILE_MINUTES * 60 - 1)
    assert not short.undecided and short.compiled is None
    long = TrainingForward(Recorder(calls), "auto", auto=True)
    long.say = said.append
    assert long.decide(11, parallel.AUTO_COMPILE_MINUTES * 60 + 1)
    assert not long.undecided and long.start == 12 and long.compiled is not None and len(said) == 1
    assert "compiling the model" in said[0] and "compile=false" in said[0]
    long.compiled = lambda x: calls.append("compiled") or x + 1  # the compiled form, without inductor's minute
    for step in (11, 12, 13):
        long(torch.zeros(1), step)
    assert calls == ["eager", "compiled", "compiled"] and long.compiled_at == 12


def _failing(x: torch.Tensor) -> torch.Tensor:
    raise torch._dynamo.exc.BackendCompilerFailed(_failing, RuntimeError("no working C++ compiler\nmore"), None)


def test_a_compile_error_falls_back_once_under_auto_and_is_raised_when_asked_for() -> None:
    calls: list[str] = []
    said: list[str] = []
    auto = TrainingForward(Recorder(calls), "on", 2, auto=True)
    auto.say = said.append
    auto.compiled = _failing
    for step in (2, 3):
        assert torch.equal(auto(torch.zeros(1), step), torch.ones(1))
    assert calls == ["eager", "eager"] and len(said) == 1 and auto.compiled is None
    assert said[0].startswith("warning: torch.compile failed, training eagerly") and \
        "RuntimeError: no working C++ compiler" in said[0] and "more" not in said[0]
    asked = TrainingForward(Recorder(calls), "on", 2)
    asked.compiled = _failing
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        asked(torch.zeros(1), 2)


def test_a_resumed_compiled_run_compiles_from_its_first_step(monkeypatch) -> None:
    monkeypatch.setattr(parallel, "_no_inductor_compiler", lambda: None)  # "auto" is possible, whatever is installed
    on = Parallelism(CPU, TrainConfig(compile=True))
    assert on.training_forward(nn.Identity(), None, 1).start == 2  # a new run: its first step eager
    assert on.training_forward(nn.Identity(), 7, 41).start == 41  # resumed: compiled at once, as the run was
    auto = Parallelism(CPU, TrainConfig())
    assert auto.training_forward(nn.Identity(), None, 1).undecided
    resumed = auto.training_forward(nn.Identity(), 12, 41)
    assert not resumed.undecided and resumed.start == 41 and resumed.auto
    assert Parallelism(CPU, TrainConfig(compile=False)).training_forward(nn.Identity(), 12, 41).compiled is None


TINY = tiny_model_toml(depth=1) + """
[train]
device = "cpu"
data = "tiny"
batch_size = 4
lr = 3e-3
warmup_steps = 2
max_steps = 20
eval_every = 10
eval_tokens = 256
log_every = 1
sample_tokens = 0
"""


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["auto", "true"])
def test_a_compiled_run_resumes_bit_for_bit(setting: str, tmp_path, monkeypatch, capsys) -> None:
    """A 20-step run, compiled ("auto" at once: its threshold set to 0 minutes, so it compiles from step 12 after
    10 timed eager steps; true from step 2), against the same run stopped at step 14 and resumed: every logged loss
    and the weights bit for bit, the checkpoint's compiled_from the same; and within rounding of an eager run."""
    monkeypatch.setattr(parallel, "AUTO_COMPILE_MINUTES", 0.0)
    data = tiny_text_data(tmp_path, "".join(f"{i}: def f(q, k): return sorted(k, key=q)\n" for i in range(300)))
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    runs = {}
    for name, extra in (("whole", []), ("part", ["--max-steps", "14", "--set", "decay_steps=20"]),
                        ("eager", ["--set", "compile=false"])):
        runs[name] = tmp_path / name
        args = ["train", "--config", str(config), "--data-dir", str(data), "--out", str(runs[name]),
                "--set", f"compile={setting}", *extra]
        assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("compiling the model") == (2 if setting == "auto" else 0), out
    assert main(["train", "--resume", str(runs["part"]), "--max-steps", "20"]) == 0
    losses = {name: {r["step"]: r["loss"] for r in _rows(run) if r["split"] == "train"} for name, run in runs.items()}
    assert losses["whole"] == losses["part"] and len(losses["whole"]) == 20
    states = {name: torch.load(run / "checkpoint.pt", weights_only=True) for name, run in runs.items()}
    assert states["whole"]["compiled_from"] == states["part"]["compiled_from"] == (12 if setting == "auto" else 2)
    assert states["eager"]["compiled_from"] is None
    assert all(torch.equal(v, states["part"]["model"][k]) for k, v in states["whole"]["model"].items())
    for step, loss in losses["eager"].items():
        assert loss == pytest.approx(losses["whole"][step], rel=1e-4), step


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


REPRO = """
import torch, torch.nn.functional as F
from routeformer import TransformerConfig, TransformerLM
from routeformer.train.parallel import pin_inductor_isa
pin_inductor_isa()
torch.manual_seed(0)
config = TransformerConfig(vocab_size=50, dim=32, depth=2, heads=4, seq_len=64, rel_clip=8, attention="full")
model = TransformerLM(config).train()
x = torch.randint(0, 50, (2, 64))
want = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
got = F.cross_entropy(torch.compile(model)(x).flatten(0, 1), x.flatten())
got.backward()
print(abs(float(got) - float(want)) < 1e-5)
"""


@pytest.mark.slow
def test_a_compile_cache_shared_by_two_capabilities_is_safe_with_the_pin(tmp_path) -> None:
    """Inductor's cache filled by a process with ATEN_CPU_CAPABILITY=avx2, then read by one on this processor's own
    (wider) capability: without ``pin_inductor_isa`` the second process corrupts its heap ("malloc(): unaligned
    tcache chunk detected", on an AVX-512 machine with this model); with it both compile their own code and agree
    with eager mode."""
    from routeformer.executors.fused.build import dispatched_capability

    if dispatched_capability() != "AVX512":
        pytest.skip("needs a processor PyTorch runs at AVX512 (the two capabilities' vectors differ in width)")
    cache = tmp_path / "inductor"
    for capability in ("avx2", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        out = subprocess.run([sys.executable, "-c", REPRO], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0 and out.stdout.split()[-1:] == ["True"], (capability, out.stderr[-3000:])


def test_the_main_step_script_times_the_loop(tmp_path) -> None:
    """scripts/main_step.py (docs/training.md, "Compiling the main job") on a small model and data set: a RESULT
    line with the median of the steps after the skipped ones."""
    data = tiny_text_data(tmp_path, "".join(f"{i}: def f(q, k): return sorted(k, key=q)\n" for i in range(300)))
    script = Path(__file__).resolve().parents[1] / "scripts" / "main_step.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "--steps", "4", "--skip", "1",
                          "--data", "tiny", "--data-dir", str(data), "--set", "dim=32", "--set", "depth=1",
                          "--set", "seq_len=64", "--set", "options.local.window=16", "--set", "rel_clip=16",
                          "--set", "device=cpu"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("RESULT median ") and float(line.split()[2]) > 0, out.stdout
