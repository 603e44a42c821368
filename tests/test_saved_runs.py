"""Runs saved by earlier versions still load and resume: the committed run directories of
``fixtures/saved_run`` (one with today's options sections, one in the old flat spelling) load as models, and
resuming one step gives the next step the code of their day gave, to rounding. (Bit for bit on the AVX2 CPU it was
made on until the router's vectors and the commitment's gradient moved into the fused kernel, which sums them in
another order; that a resumed run repeats an uninterrupted one bit for bit is test_train.py's.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from routeformer.cli import main
from routeformer.model import TransformerLM

FIXTURE = Path(__file__).parent / "fixtures" / "saved_run"
THREADS = 2  # the threads it was made with: a matmul's sums are split by thread, so the rounding depends on them


@pytest.mark.parametrize("name", ["run", "run_flat"])
def test_a_saved_run_loads_with_its_options(name: str) -> None:
    for weights in (FIXTURE / name, FIXTURE / name / "best"):
        model = TransformerLM.from_pretrained(weights)
        routing = model.config.options["routing"]
        assert (routing.num_clusters, routing.window, routing.probes, routing.balance) == (3, 8, 2, 0.01)
        assert model.config.options["local"].window == 8 and model.config.rel_clip == 8


@pytest.mark.parametrize("name", ["run", "run_flat"])
def test_resuming_a_saved_run_gives_the_next_step_of_its_day(name: str, tmp_path, monkeypatch) -> None:
    shutil.copytree(FIXTURE / "data", tmp_path / "data")  # the run's config names data_dir = "data"
    shutil.copytree(FIXTURE / name, tmp_path / "run")
    config = tmp_path / "run" / "config.toml"  # saved with device "auto": a GPU machine's would take its GPU
    config.write_text(config.read_text().replace('device = "auto"', 'device = "cpu"'))
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # pytest-xdist gives each worker its share of the cores
    try:
        assert main(["train", "--resume", "run", "--max-steps", "7"]) == 0
    finally:
        torch.set_num_threads(threads)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["step"] == 7
    expected = load_file(FIXTURE / "expected_step7.safetensors")
    assert set(state["model"]) == set(expected)
    for key, want in expected.items():  # today's kernels add the sums in another order than that day's
        torch.testing.assert_close(state["model"][key], want, rtol=1e-5, atol=1e-6, msg=key)
