"""The training loop: optimiser steps until ``max_steps``, the time budget or a stop request.

A step: the learning rate of the schedule, ``grad_accum`` micro-batches (forward, cross-entropy + the model's
auxiliary loss, backward; gradients synchronised on the last), unscaling and gradient clipping, AdamW, then the
head groups' per-step hooks (``after_optimizer_step``: routing's k-means step). Every ``log_every`` steps a row of
training metrics; every ``eval_every`` steps, at the end and on a stop: validation, then the checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..data import BatchSampler
from ..data.pairs import IGNORED, PairBatches
from ..model import TransformerLM, check_token_ids
from ..model.seq2seq import Seq2SeqLM
from . import distributed
from .checkpoint import Checkpointer, Progress
from .config import TrainConfig
from .evaluation import Validator, metric
from .parallel import Parallelism, TrainingForward
from .rundir import RunDirectory
from .schedule import TimeShare, learning_rate
from .signals import Diverged, Interrupted, StopRequest

SHORT_UNITS = {"bytes": "bpb", "words": "ppl", "images": "bpd"}


def adamw(core: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings (parameters of two or more dimensions) only, not on
    biases whatever their shape (a per-head bias such as nsa's gate bias is (heads, 3)); built after sharding, so
    that it holds this rank's shards. PyTorch's fused implementation (one kernel for every parameter:
    about 5× faster than the default on the main job's CPU step) where every parameter is a plain floating tensor
    on the CPU or CUDA; otherwise (sharded DTensors) the default."""
    named = list(core.named_parameters())
    params = [p for _, p in named]
    decayed = {id(p) for name, p in named if p.dim() >= 2 and not name.endswith("bias")}
    decay = [p for p in params if id(p) in decayed]
    rest = [p for p in params if id(p) not in decayed]
    fused = all(type(p) is nn.Parameter and p.device.type in ("cpu", "cuda") and p.is_floating_point()
                for p in params)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-9, fused=fused or None)


@dataclass(frozen=True)
class Parts:
    """What a run trains: ``model`` (the forward of ``core``'s data-parallel form, compiled or not), ``core`` (the
    unwrapped model), its ``optimizer``, and the ``sampler`` of its batches (its seq_len is the run's; an
    encoder-decoder run's ``PairLoop`` takes ``PairBatches`` and a ``Seq2SeqLM``)."""

    model: TrainingForward
    core: TransformerLM | Seq2SeqLM
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler | PairBatches


@dataclass(frozen=True)
class Services:
    """What the loop works with: the processes and precision (``parallel``), the run directory, the validation
    (its metric's kind is the run's), the checkpoints, and the stop request (Ctrl-C / SIGTERM)."""

    parallel: Parallelism
    directory: RunDirectory
    validator: Validator
    checkpointer: Checkpointer
    stop: StopRequest


class Loop:
    """Trains ``parts.model`` with ``parts.optimizer`` on the batches of ``parts.sampler`` from ``progress.step``
    on, validating, saving and stopping through ``services``."""

    def __init__(self, cfg: TrainConfig, parts: Parts, services: Services, progress: Progress) -> None:
        self.cfg, self.progress = cfg, progress
        self.model, self.core, self.optimizer, self.sampler = parts.model, parts.core, parts.optimizer, parts.sampler
        self.kind = services.validator.kind
        self.parallel, self.procs = services.parallel, services.parallel.procs
        self.directory, self.validator = services.directory, services.validator
        self.checkpointer, self.stop = services.checkpointer, services.stop
        self.lr = math.nan  # the learning rate of the last step
        self.tokens = 0  # the tokens trained on in this invocation, over all ranks (the speed's count)

    def run(self, resume: bool) -> str:
        """Steps until max_steps, the time budget or a stop request; returns why it stopped: "max_steps", "time
        budget" or "interrupted". Everything is saved when it returns."""
        from tqdm import tqdm

        cfg, procs, progress = self.cfg, self.procs, self.progress
        start_time = time.monotonic()
        budget = cfg.max_minutes * 60 if cfg.max_minutes else math.inf
        bar = tqdm(total=cfg.max_steps, initial=progress.step, unit="step", dynamic_ncols=True, mininterval=1.0,
                   disable=not procs.main)
        if procs.main:
            self.model.say = bar.write  # "auto"'s choice and a compile fallback, under the bar
        last_eval = progress.step if resume else -1
        saved = last_eval  # the step whose state checkpoint.pt holds (-1: none yet)
        first_step = progress.step
        rate_time, rate_steps, rate_tokens = time.monotonic(), 0, 0
        shown, train = "", math.nan  # the last training row, as the bar shows it, and its mean loss
        speed = math.nan
        checked = False  # whether the time budget was compared with max_steps yet
        # The per-step estimate counts from the end of the last step that held a one-time cost: this invocation's
        # first (the fused kernels compile at first use, ~30 s from an empty cache) and the first compiled one.
        warm_until, warm_done = first_step, 0.0  # that step and the seconds into the run it ended at
        stopped = "max_steps"
        shares = TimeShare(cfg, budget, progress.time_share)
        synced = 0.0  # seconds into the budget, the mean over ranks: every rank computes the same learning rate
        try:
            while progress.step < cfg.max_steps:
                share = shares.at(progress.step + 1, synced)
                local_loss = self.step(progress.step + 1, share)
                progress.step += 1
                progress.time_share = max(progress.time_share, share)
                rate_steps += 1
                elapsed = time.monotonic() - start_time
                # One reduction a step: the mean loss, whether some rank was asked to stop or ran out of time (so
                # that every rank stops at the same step), and the time used (so that every rank decays alike).
                loss_sum, interrupted, out_of_time, elapsed_sum = distributed.sum_all(
                    [local_loss, float(self.stop.requested), float(elapsed >= budget), elapsed], procs)
                synced = elapsed_sum / procs.world
                if not math.isfinite(loss_sum):  # every rank sees the same sum: all stop here, nothing saved
                    raise Diverged(self.directory.path, progress.step, loss_sum / procs.world,
                                   saved if saved >= 0 else None)
                progress.window["loss"] += loss_sum / procs.world
                progress.window["steps"] += 1
                if progress.step % cfg.log_every == 0 or progress.step == cfg.max_steps:
                    mean = progress.window["loss"] / progress.window["steps"]
                    speed = (self.tokens - rate_tokens) / max(time.monotonic() - rate_time, 1e-9)
                    self.directory.write({"step": progress.step, "split": "train", "loss": mean,
                                          "value": metric(self.kind, mean), "lr": self.lr,
                                          "tokens_per_s": speed, "elapsed_s": elapsed})
                    shown = (f"loss {mean:.3f}, {SHORT_UNITS[self.kind]} {metric(self.kind, mean):.3f}, "
                             f"{speed:,.0f} tok/s, ")
                    train = mean
                    progress.window = {"loss": 0.0, "steps": 0}
                    rate_time, rate_steps, rate_tokens = time.monotonic(), 0, self.tokens
                if progress.step == first_step + 1 or progress.step == self.model.compiled_at:
                    warm_until, warm_done = progress.step, elapsed
                if self.model.compiled_at is not None and progress.compiled_from is None:
                    progress.compiled_from = self.model.compiled_at  # a resumed run compiles from its first step
                timed = progress.step - warm_until  # steps after those, evaluations included
                per_step = (elapsed - warm_done) / timed if timed else elapsed / (progress.step - first_step)
                left = _time_left(cfg.max_steps - progress.step, per_step, budget - elapsed)
                if self.model.undecided and timed >= BUDGET_CHECK_STEPS:
                    self.model.decide(progress.step, left)  # compile = "auto", on the eager steps' pace
                elif not checked and timed and not self.model.undecided and (
                        timed >= BUDGET_CHECK_STEPS or elapsed >= budget / 10):
                    checked = True  # once, on an estimate of a few steps
                    short = budget_warning(cfg, progress.step, per_step, budget - elapsed)
                    if short and procs.main:
                        bar.write(f"warning: {short}")
                bar.set_postfix_str(f"{shown}left {_clock(left)}", refresh=False)  # time left: every step
                bar.update(1)
                if interrupted:
                    stopped = "interrupted"
                elif out_of_time:
                    stopped = "time budget"
                if progress.step % cfg.eval_every == 0 or progress.step == cfg.max_steps or stopped != "max_steps":
                    if stopped != "interrupted":
                        window = progress.window  # the steps since the last training row, if any
                        recent = window["loss"] / window["steps"] if window["steps"] else train
                        if rate_steps:
                            speed = (self.tokens - rate_tokens) / max(time.monotonic() - rate_time, 1e-9)
                        valid = self.validator.estimate(progress.step)
                        self.checkpointer.keep_if_best(valid)
                        elapsed = time.monotonic() - start_time
                        left = 0.0 if stopped != "max_steps" else _time_left(
                            cfg.max_steps - progress.step, elapsed / (progress.step - first_step), budget - elapsed)
                        if procs.main:  # under the bar, and kept on screen
                            bar.write(validation_line(progress.step, self.kind, recent, valid, speed, elapsed, left))
                    self.checkpointer.save()
                    last_eval = saved = progress.step
                if stopped != "max_steps":
                    break
            if last_eval != progress.step:
                self.checkpointer.save()
        finally:
            bar.close()
        return stopped

    def step(self, step: int, time_share: float = 0.0) -> float:
        """Optimiser step ``step`` (1-based) at the learning rate of the schedule with the time budget's share
        ``time_share`` of the decay used; returns this rank's mean loss (the caller averages ranks)."""
        cfg = self.cfg
        self.start_step(step, time_share)
        losses = []
        # shorter rows during a warm-up that asks for them (the routing heads' dense one, or the length warm-up)
        length = min(self.core.config.train_len(step - 1), cfg.train_len(step, self.sampler.seq_len))
        for micro in range(cfg.grad_accum):
            # cut, then a curriculum's repeats; with pack each token's document, and with pack = "documents" the
            # predictions that count (none of padding, none across a document's end)
            tokens, documents, scored = self.sampler.rows(step, micro, cfg.grad_accum, length)
            check_token_ids(tokens, self.core.config.vocab_size)  # on the host: no device sync
            targets = tokens[:, 1:] if scored is None else tokens[:, 1:].masked_fill(~scored, IGNORED)
            tokens = tokens.to(self.procs.device, non_blocking=True)
            targets = targets.to(self.procs.device, non_blocking=True)
            if documents is not None:
                documents = documents[:, :-1].to(self.procs.device, non_blocking=True)
            last = micro == cfg.grad_accum - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                with self.parallel.autocast():
                    logits = self.model(tokens[:, :-1], step, documents)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORED)
                    objective = (loss + self.core.aux_loss.float()) / cfg.grad_accum
                self.parallel.scaler.scale(objective).backward()
            losses.append(loss.detach())
        self.tokens += cfg.batch_size * self.sampler.seq_len
        return self.finish_step(step, losses)

    def start_step(self, step: int, time_share: float) -> None:
        """The schedule's learning rate into the optimiser, the gradients cleared."""
        self.lr = lr = learning_rate(step, self.cfg, time_share)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def finish_step(self, step: int, losses: list[torch.Tensor]) -> float:
        """Unscaling, clipping, the optimiser step and the head groups' per-step hooks; this rank's mean of the
        micro-batches' ``losses``."""
        cfg = self.cfg
        scaler = self.parallel.scaler
        scaler.unscale_(self.optimizer)
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.core.parameters(), cfg.clip)
        scaler.step(self.optimizer)
        scaler.update()
        # The head groups' per-step hooks, after the optimiser step (routing: the k-means step).
        self.core.after_optimizer_step(step)
        # This rank's loss (one device-to-host copy a step, not one per micro-batch); the loop averages ranks.
        return sum(x / cfg.grad_accum for x in torch.stack(losses).tolist())


def run_loop(loop: Loop, resume: bool) -> str:
    """``loop.run`` under the stop signals: Ctrl-C during the loop stops at the end of the step and saves, and
    raises ``Interrupted``; after the loop everything is saved, so Ctrl-C during the final evaluation and sample
    interrupts at once (KeyboardInterrupt). Returns why the loop stopped."""
    with loop.stop.handling(), loop.model.reproducible():
        stopped = loop.run(resume)
    if stopped == "interrupted":
        raise Interrupted(loop.directory.path, loop.progress.step)
    return stopped


BUDGET_CHECK_STEPS = 10  # the time budget is compared with max_steps once: this many steps after the first (or a tenth
# of the budget)


def budget_warning(cfg: TrainConfig, step: int, per_step: float, time_left: float) -> str | None:
    """Why the time budget will stop the run before ``max_steps`` at ``per_step`` seconds a step, or None."""
    if not math.isfinite(time_left) or (cfg.max_steps - step) * per_step <= time_left:
        return None
    reach = step + int(time_left / per_step)
    follows = (", so the cosine decay follows the time budget (it reaches min_lr when the time is up)"
               if TimeShare.applies(cfg, time_left) else ", before the learning-rate schedule has decayed")
    return (f"at {per_step:.2f} s a step the time budget ({cfg.max_minutes:g} min) stops the run near step {reach:,} "
            f"of max_steps {cfg.max_steps:,}{follows}")


def schedule_warnings(cfg: TrainConfig) -> list[str]:
    """Settings that make the learning-rate schedule do something else than it says."""
    if cfg.warmup_steps >= cfg.max_steps:
        return [f"warmup_steps ({cfg.warmup_steps:,}) >= max_steps ({cfg.max_steps:,}): the run ends in its "
                f"learning-rate warm-up (the rate never reaches lr={cfg.lr:g} and never decays)"]
    return []


def validation_line(step: int, kind: str, train: float, valid: float, speed: float, elapsed: float,
                    left: float) -> str:
    """The line a periodic validation prints: step, training and validation metric, speed, time used and left."""
    unit = SHORT_UNITS[kind]
    return (f"step {step}: train {unit} {metric(kind, train):.3f}, valid {unit} {metric(kind, valid):.3f}, "
            f"{speed:,.0f} tok/s, elapsed {_clock(elapsed)}, left {_clock(left)}")


def _time_left(steps: int, per_step: float, budget_left: float) -> float:
    """Seconds until the run ends: its remaining steps at ``per_step``, or the time budget if that comes first."""
    return min(steps * per_step, budget_left)


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
