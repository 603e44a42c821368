"""The training loop: data-parallel across torchrun processes, resumable exactly, stoppable at any moment.

A step: ``grad_accum`` micro-batches (forward, cross-entropy + the model's auxiliary loss, backward), gradient
clipping, AdamW, then the head groups' per-step hooks (``after_optimizer_step``: routing's k-means step). Every
``eval_every`` steps and at the end: validation loss, the run state (``checkpoint.pt``), the last weights
(``model.safetensors`` + ``config.json``) and, when the validation loss improves, the best weights (``best/``).
Ctrl-C (SIGINT) or SIGTERM: every rank stops at the same step boundary, the state is saved, and the process exits
with status 130.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data import BatchSampler, DataError, Dataset
from ..durable import atomic_write
from ..model import TransformerLM
from ..model.pretrained import save_pretrained
from . import distributed
from .checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from .config import RunConfig
from .evaluation import UNITS, evaluate, metric
from .metrics import MetricsLog, plot_losses, truncate_metrics
from .runs import check_sample_layout
from .schedule import learning_rate


class Interrupted(Exception):
    """Training stopped on Ctrl-C / SIGTERM after saving its state."""

    def __init__(self, run_dir: Path, step: int) -> None:
        super().__init__(f"interrupted at step {step}; state saved in {run_dir / CHECKPOINT} (continue with "
                         f"`routeformer train --resume {run_dir}`)")
        self.run_dir, self.step = run_dir, step


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    stopped: str
    unit: str
    valid: float | None
    sample: str | None
    plot: Path | None
    minutes: float  # from the start to the end of training
    final_seconds: float  # the whole-split evaluation and the sample


def new_run_dir(run: RunConfig, out: str | Path | None) -> Path:
    if out is not None:
        return Path(out).expanduser()
    return Path("runs") / f"{run.train.data}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def train(run: RunConfig, run_dir: Path, *, resume: bool = False, echo=print) -> TrainResult:
    """Train ``run`` in ``run_dir`` (continuing its checkpoint when ``resume``)."""
    procs = distributed.start(run.train.device)
    try:
        return _Trainer(run, run_dir, procs, resume, echo).execute()
    finally:
        distributed.stop(procs)


class _Trainer:
    def __init__(self, run: RunConfig, run_dir: Path, procs: distributed.Processes, resume: bool, echo) -> None:
        self.run, self.cfg, self.run_dir, self.procs, self.echo = run, run.train, run_dir, procs, echo
        self.resume = resume
        self.stop_request: str | None = None

    # --- set-up -----------------------------------------------------------------------------------------------
    def _prepare_dir(self) -> None:
        if self.procs.main:
            if not self.resume and (self.run_dir / CHECKPOINT).exists():
                raise ValueError(f"{self.run_dir} already holds a run; continue it with --resume {self.run_dir} or "
                                 f"choose another --out")
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ValueError(f"cannot create the run directory {self.run_dir}: {err.strerror}") from None
            # Written on resume too: a changed --max-steps / --max-minutes holds for the next --resume as well.
            text = self.run.to_toml()
            atomic_write(self.run_dir / "config.toml", lambda tmp: Path(tmp).write_text(text))
            if not self.resume:  # rows of an earlier start that died before its first checkpoint
                (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        if self.procs.distributed:
            dist.barrier()

    def _open_data(self) -> None:
        self.data = Dataset.open(self.cfg.data, self.cfg.data_dir)
        meta, model = self.data.meta, self.run.model
        if model.vocab_size != meta.vocab_size:
            raise DataError(f"the model's vocab_size ({model.vocab_size}) does not match the vocabulary of data set "
                            f"{meta.name!r} ({meta.vocab_size}); set --set vocab_size={meta.vocab_size}")
        for split in ("train", "valid"):
            if meta.splits[split] < model.seq_len + 1:
                raise DataError(f"seq_len ({model.seq_len}) + 1 is longer than the {split} split of {meta.name!r} "
                                f"({meta.splits[split]} tokens); lower it with --set seq_len=...")
        check_sample_layout(model, meta)
        self.kind, self.unit = meta.kind, UNITS[meta.kind]

    def _precision(self) -> None:
        dev, choice = self.procs.device, self.cfg.precision
        if choice == "auto":
            if dev.type == "cuda":
                choice = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
            else:
                choice = "float32"
        self.precision = choice
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(choice)
        self.autocast = (lambda: torch.autocast(dev.type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(dev.type, enabled=choice == "float16")

    def _build(self, state: dict | None) -> None:
        torch.manual_seed(self.cfg.seed)  # the same initial weights on every rank
        core = TransformerLM(self.run.model)
        self.num_params = core.num_parameters()  # before sharding, which leaves each rank a part
        if state is not None:
            core.load_state_dict(state["model"])
        self.core = core.to(self.procs.device)
        decay = [p for p in core.parameters() if p.dim() >= 2]
        rest = [p for p in core.parameters() if p.dim() < 2]
        self.model: nn.Module = core
        if self.procs.distributed and self.cfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in core.blocks:
                fully_shard(block)
            fully_shard(core)
            decay = [p for p in core.parameters() if p.dim() >= 2]
            rest = [p for p in core.parameters() if p.dim() < 2]
        elif self.procs.distributed:
            from torch.nn.parallel import DistributedDataParallel

            # Buffers are not broadcast: the k-means statistics each rank gathers are its own until the
            # all-reduce of after_optimizer_step(), which keeps the centroids identical.
            self.model = DistributedDataParallel(
                core, device_ids=[self.procs.device.index] if self.procs.device.type == "cuda" else None,
                broadcast_buffers=False)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2), eps=1e-9)
        if state is not None:
            if self.cfg.fsdp and self.procs.distributed:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                set_optimizer_state_dict(core, self.optimizer, state["optimizer"],
                                         options=StateDictOptions(full_state_dict=True))
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
        if self.cfg.compile:
            self.model = torch.compile(self.model)

    # --- the run --------------------------------------------------------------------------------------------------
    def execute(self) -> TrainResult:
        self.started = time.monotonic()
        self._open_data()  # first: a start that fails on its data leaves no run directory behind
        self._prepare_dir()
        self._precision()
        state = load_checkpoint(self.run_dir) if self.resume else None
        self._build(state)
        self.step = int(state["step"]) if state else 0
        self.best = float(state["best"]) if state else math.inf
        self.window = dict(state["window"]) if state else {"loss": 0.0, "steps": 0}
        if state is not None:
            rng = state["rng"][self.procs.rank % len(state["rng"])]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"], self.procs.device)
        if self.procs.main and self.resume:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.log = MetricsLog(self.run_dir, tensorboard=self.cfg.tensorboard, wandb_project=self.cfg.wandb,
                              config={"model": vars(self.run.model), "train": vars(self.cfg)}) \
            if self.procs.main else None
        self.sampler = BatchSampler(self.data.split("train"), self.run.model.seq_len, self.cfg.batch_size,
                                    seed=self.cfg.seed, rank=self.procs.rank, world=self.procs.world,
                                    align=self.data.meta.sample_length or 1)
        self.sampler.batch(self.step + 1, 0, self.cfg.grad_accum)  # fail early on an impossible batch split
        self._announce()
        try:
            # Ctrl-C during the loop stops at the end of the step and saves. After the loop everything is saved,
            # so Ctrl-C during the final evaluation and sample interrupts at once (KeyboardInterrupt).
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                stopped = self._loop()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
            if stopped == "interrupted":
                raise Interrupted(self.run_dir, self.step)
            return self._finish(stopped)
        finally:
            if self.log is not None:
                self.log.close()

    def _short_unit(self) -> str:
        return {"bytes": "bpb", "words": "ppl", "images": "bpd"}[self.kind]

    def _on_signal(self, signum, frame) -> None:
        if self.stop_request == "interrupted":  # a second Ctrl-C: stop now (the last checkpoint stays intact)
            raise KeyboardInterrupt
        self.stop_request = "interrupted"
        if self.procs.main:
            self.echo("\nstopping at the end of this step (Ctrl-C again to abort without saving)")

    def _announce(self) -> None:
        if not self.procs.main:
            return
        m, c = self.run.model, self.cfg
        what = "resuming" if self.resume else "training"
        sharded = " (sharded by FSDP2)" if c.fsdp and self.procs.distributed else ""
        self.echo(f"{what} {self.num_params / 1e6:.2f}M-parameter model{sharded} "
                  f"({m.depth} layers, dim {m.dim}, attention {m.attention}) on {c.data} ({self.unit}), "
                  f"seq_len {m.seq_len}, batch {c.batch_size}, {self.procs.world} process(es) on "
                  f"{self.procs.device}, {self.precision}; run directory {self.run_dir}")

    def _loop(self) -> str:
        from tqdm import tqdm

        cfg, procs = self.cfg, self.procs
        start_time = time.monotonic()
        budget = cfg.max_minutes * 60 if cfg.max_minutes else math.inf
        bar = tqdm(total=cfg.max_steps, initial=self.step, unit="step", dynamic_ncols=True, mininterval=1.0,
                   disable=not procs.main)
        tokens_per_step = cfg.batch_size * self.run.model.seq_len
        last_eval = self.step if self.resume else -1
        first_step = self.step
        rate_time, rate_steps = time.monotonic(), 0
        stopped = "max_steps"
        try:
            while self.step < cfg.max_steps:
                local_loss = self._train_step(self.step + 1)
                self.step += 1
                rate_steps += 1
                elapsed = time.monotonic() - start_time
                # One reduction a step: the mean loss, and whether some rank was interrupted or ran out of time
                # (so that every rank stops at the same step).
                loss_sum, interrupted, out_of_time = distributed.sum_all(
                    [local_loss, float(self.stop_request == "interrupted"), float(elapsed >= budget)], procs)
                self.window["loss"] += loss_sum / procs.world
                self.window["steps"] += 1
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                    mean = self.window["loss"] / self.window["steps"]
                    speed = rate_steps * tokens_per_step / max(time.monotonic() - rate_time, 1e-9)
                    self._write({"step": self.step, "split": "train", "loss": mean, "value": metric(self.kind, mean),
                                 "lr": learning_rate(self.step, cfg), "tokens_per_s": speed,
                                 "elapsed_s": elapsed})
                    per_step = elapsed / (self.step - first_step)  # this invocation's average, evaluations included
                    left = min((cfg.max_steps - self.step) * per_step, budget - elapsed)
                    bar.set_postfix_str(f"loss {mean:.3f}, {self._short_unit()} {metric(self.kind, mean):.3f}, "
                                        f"{speed:,.0f} tok/s, left {_clock(left)}", refresh=False)
                    self.window = {"loss": 0.0, "steps": 0}
                    rate_time, rate_steps = time.monotonic(), 0
                bar.update(1)
                if interrupted:
                    stopped = "interrupted"
                elif out_of_time:
                    stopped = "time budget"
                if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps or stopped != "max_steps":
                    if stopped != "interrupted":
                        self._validate()
                    self._save()
                    last_eval = self.step
                if stopped != "max_steps":
                    break
            if last_eval != self.step:
                self._save()
        finally:
            bar.close()
        return stopped

    def _train_step(self, step: int) -> float:
        cfg = self.cfg
        lr = learning_rate(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for micro in range(cfg.grad_accum):
            tokens = self.sampler.batch(step, micro, cfg.grad_accum).to(self.procs.device, non_blocking=True)
            last = micro == cfg.grad_accum - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with self.autocast():
                    logits = self.model(tokens[:, :-1])
                    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                    objective = (loss + self.core.aux_loss.float()) / cfg.grad_accum
                self.scaler.scale(objective).backward()
            losses.append(loss.detach())
        self.scaler.unscale_(self.optimizer)
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.core.parameters(), cfg.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.core.after_optimizer_step(step)  # the head groups' per-step hooks (routing: k-means)
        # This rank's loss (one device-to-host copy a step, not one per micro-batch); the loop averages ranks.
        return sum(x / cfg.grad_accum for x in torch.stack(losses).tolist())

    def _validate(self, full: bool = False) -> float:
        tokens = self.data.split("valid")
        seq = self.run.model.seq_len
        max_windows = None if full else max(1, self.cfg.eval_tokens // seq)
        micro = max(1, self.cfg.batch_size // max(1, self.procs.world * self.cfg.grad_accum))
        batch = 4 * micro  # no gradients to keep: larger batches than training's, for throughput
        total, count = evaluate(self.core, tokens, seq, batch=batch, procs=self.procs, autocast=self.autocast(),
                                max_windows=max_windows)
        mean = total / max(count, 1)
        if not full:
            in_sync = distributed.routing_in_sync(self.core, self.procs)
            if not in_sync:
                raise RuntimeError("routing centroids differ between ranks; this is a bug, please report it")
            self._write({"step": self.step, "split": "valid", "loss": mean, "value": metric(self.kind, mean),
                         "routing_in_sync": in_sync})
            if mean < self.best:
                self.best = mean
                self._save_weights(self.run_dir / "best")
        return mean

    def _write(self, row: dict) -> None:
        if self.log is not None:
            self.log.write(row)

    def _full_state(self) -> tuple[dict, dict]:
        if self.cfg.fsdp and self.procs.distributed:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (get_model_state_dict(self.core, options=options),
                    get_optimizer_state_dict(self.core, self.optimizer, options=options))
        return self.core.state_dict(), self.optimizer.state_dict()

    def _save_weights(self, directory: Path, model_state: dict | None = None) -> None:
        """model.safetensors + config.json in ``directory`` (rank 0). Sharded parameters are gathered first
        (every rank takes part) unless ``model_state`` already holds the full state."""
        sharded = self.cfg.fsdp and self.procs.distributed
        if sharded and model_state is None:
            model_state, _ = self._full_state()
        if self.procs.main:
            if sharded:
                shadow = TransformerLM(self.run.model)
                shadow.load_state_dict(model_state)
                save_pretrained(shadow, directory)
            else:
                save_pretrained(self.core, directory)

    def _save(self) -> None:
        model_state, optim_state = self._full_state()
        rng = {"cpu": torch.get_rng_state()}
        if self.procs.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.procs.device)
        rngs = [rng]
        if self.procs.distributed:
            rngs = [None] * self.procs.world
            dist.all_gather_object(rngs, rng)
        if self.procs.main:
            save_checkpoint(self.run_dir, {
                "model": {k: v.detach().cpu() for k, v in model_state.items()}, "optimizer": optim_state,
                "scaler": self.scaler.state_dict(), "step": self.step, "best": self.best, "rng": rngs,
                "window": self.window,
            })
        self._save_weights(self.run_dir, model_state)
        if self.procs.distributed:
            dist.barrier()

    def _finish(self, stopped: str) -> TrainResult:
        minutes = (time.monotonic() - self.started) / 60
        final_start = time.monotonic()
        mean = self._validate(full=True)
        valid = metric(self.kind, mean)
        self._write({"step": self.step, "split": "valid_full", "loss": mean, "value": valid})
        sample = self._sample()
        png = None
        if self.procs.main and plot_losses(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png", self.unit):
            png = self.run_dir / "loss.png"
        return TrainResult(self.run_dir, self.step, stopped, self.unit, valid, sample, png, minutes,
                           time.monotonic() - final_start)

    def _sample(self) -> str | None:
        if self.kind == "images" or self.cfg.sample_tokens == 0:
            return None
        tokens = np.asarray(self.data.split("valid")[:4096])
        start = 0
        if self.kind == "bytes":  # begin at a line start, as a reader would
            newline = np.flatnonzero(tokens[:-64] == 10)
            start = int(newline[0]) + 1 if len(newline) else 0
        prompt = torch.from_numpy(tokens[start:start + 64].astype(np.int64))[None].to(self.procs.device)
        with self.autocast():
            out = self.core.generate(prompt, self.cfg.sample_tokens, temperature=0.8, top_p=0.95,
                                     seed=self.cfg.seed)
        return decode(out[0].tolist(), self.kind, self.data.vocab())


def decode(ids: list[int], kind: str, vocab: list[str] | None) -> str:
    """Tokens as text: bytes as UTF-8 (invalid sequences replaced), words joined by spaces (<eos> = newline)."""
    if kind == "words" and vocab is not None:
        return " ".join(vocab[i] for i in ids).replace(" <eos> ", "\n").replace("<eos>", "\n")
    return bytes(ids).decode("utf-8", errors="replace")


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
