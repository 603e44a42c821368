"""Data-parallel training: two gloo processes under torchrun against one process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_model_toml, tiny_text_data
from routeformer.cli import main

CONFIG = tiny_model_toml(depth=2) + """
[train]
device = "cpu"  # gloo on the CPU, also where there are GPUs (rank 1 would otherwise go to cuda:1)
data = "tiny"
batch_size = 8
grad_accum = {accum}
lr = 3e-3
warmup_steps = 2
max_steps = 8
eval_every = 4
eval_tokens = 512
log_every = 1
sample_tokens = 8
"""


def _rows(run: Path, split: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """Data, configurations, and the reference: one process, two micro-batches of 4 per step."""
    root = tmp_path_factory.mktemp("dist")
    tiny_text_data(root, "".join(f"{i} x = routing(q, k, v)  # line {i % 17}\n" for i in range(400)))
    (root / "one.toml").write_text(CONFIG.format(accum=2))
    (root / "two.toml").write_text(CONFIG.format(accum=1))  # two processes: one micro-batch of 4 each
    assert main(["train", "--config", str(root / "one.toml"), "--data-dir", str(root / "data"), "--out",
                 str(root / "one")]) == 0
    return root


def _torchrun(root: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
         "routeformer", "train", *args], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{nproc} process(es)" in done.stdout  # rank 0 alone talks and writes
    assert done.stdout.count("validation bits per byte") == 1
    return done


def _same_curve(one: Path, two: Path) -> None:
    a, b = _rows(one, "train"), _rows(two, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4), (x, y)
    valid = {r["step"]: r for r in _rows(two, "valid")}  # a run stopped early also evaluates where it stopped
    assert {4, 8} <= set(valid)  # (a rank out of sync would have stopped the run: see the test below)
    for x in _rows(one, "valid"):
        assert valid[x["step"]]["loss"] == pytest.approx(x["loss"], rel=1e-4), (x, valid[x["step"]])
    c1 = torch.load(one / "checkpoint.pt", weights_only=True)["model"]
    c2 = torch.load(two / "checkpoint.pt", weights_only=True)["model"]
    assert set(c1) == set(c2)  # a full (unsharded) state, whichever way it was trained
    for key in (k for k in c1 if k.endswith("kmeans.centroids")):
        torch.testing.assert_close(c2[key], c1[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_follow_one_process_with_the_same_global_batch(single: Path, mode: str) -> None:
    out = single / mode
    _torchrun(single, "--config", str(single / "two.toml"), "--data-dir", str(single / "data"), "--out", str(out),
              *(["--fsdp"] if mode == "fsdp" else []))
    _same_curve(single / "one", out)


@pytest.mark.slow  # 8 s a worker each (2026-12-07); the two-process tests keep DDP and FSDP2 in the default suite
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_one_process_under_torchrun_runs_in_a_process_group(single: Path, mode: str) -> None:
    """A one-GPU user's torchrun: one gloo process wraps the model in DDP or shards it with FSDP2 as a larger run
    does, and follows the plain process's curve (the same batches: two micro-batches of 4 per step)."""
    out = single / f"one_{mode}"
    done = _torchrun(single, "--config", str(single / "one.toml"), "--data-dir", str(single / "data"), "--out",
                     str(out), *(["--fsdp"] if mode == "fsdp" else []), nproc=1)
    assert ("(sharded by FSDP2)" if mode == "fsdp" else "1 process(es) with DDP on cpu") in done.stdout
    _same_curve(single / "one", out)


@pytest.mark.slow  # two torchrun launches and a resume, about 30 s: CI's slow line runs it
def test_a_sharded_run_resumes_on_the_same_curve(single: Path) -> None:
    out = single / "fsdp_resumed"
    _torchrun(single, "--config", str(single / "two.toml"), "--data-dir", str(single / "data"), "--out", str(out),
              "--fsdp", "--max-steps", "6", "--set", "decay_steps=8")
    _torchrun(single, "--resume", str(out), "--max-steps", "8")
    _same_curve(single / "one", out)


def _sync_worker(rank: int, store: str, out: str, dtype: str) -> None:
    import torch.distributed as dist

    from routeformer import TransformerConfig, TransformerLM
    from routeformer.train.distributed import Processes, routing_in_sync

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    procs = Processes(rank, 2, rank, torch.device("cpu"))
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=16, dim=16, depth=1, heads=2, seq_len=16,
                                            attention="local:1,routing:1", rel_clip=4, options={
                                                "local": {"window": 4}, "routing": {
                                                    "num_clusters": 2, "window": 4, "balance": 0.01, "warmup": 3}}))
    model = model.to(getattr(torch, dtype))
    same = routing_in_sync(model, procs)
    drifted = {}
    for name in ("kmeans.centroids", "routing.bias", "routing.steps"):  # one ulp (one step) on one rank
        buf = next(b for n, b in model.named_buffers() if n.endswith(name))
        before = buf.clone()
        if rank == 1:  # the next representable value: its bits as an integer, plus one
            bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(buf.dtype, buf.dtype)
            buf.view(bits).view(-1)[0] += 1
        drifted[name] = routing_in_sync(model, procs)
        buf.copy_(before)
    if rank == 0:
        torch.save({"same": same, **drifted}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_sync_check_sees_one_ulp_of_drift_in_centroids_bias_or_warm_up_count(tmp_path, dtype: str) -> None:
    import torch.multiprocessing as mp

    out = tmp_path / "result.pt"
    mp.spawn(_sync_worker, args=(str(tmp_path / "store"), str(out), dtype), nprocs=2, join=True)
    result = torch.load(out)
    assert result == {"same": True, "kmeans.centroids": False, "routing.bias": False, "routing.steps": False}
