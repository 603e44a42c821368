"""Precision and parallelism: on which processes and device the model trains (train/distributed.py), in which
precision (autocast and the gradient scaler), and in which data-parallel form: replicated by DDP, or its blocks
sharded by FSDP2 (``fsdp``); compiled when asked. Also the collective forms of the states a checkpoint needs
from a sharded model and optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from .config import TrainConfig
from .distributed import Processes


def resolve_precision(precision: str, device: torch.device) -> str:
    """What precision ``auto`` is on ``device`` (bfloat16 on CUDA where supported, else float16; float32
    elsewhere); other values as they are."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


class Parallelism:
    def __init__(self, procs: Processes, cfg: TrainConfig) -> None:
        self.procs = procs
        if cfg.fsdp and not procs.distributed:
            raise ValueError("fsdp shards the model across the processes of torchrun; this run was not started by "
                             "torchrun (start it with torchrun --nproc-per-node N, 1 included, or drop --fsdp)")
        self.sharded = cfg.fsdp
        self.compile = cfg.compile
        dev = procs.device
        self.precision = choice = resolve_precision(cfg.precision, dev)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(choice)
        # A new context manager at each call: forward passes of training, evaluation and sampling run under it.
        self.autocast: Callable[[], contextlib.AbstractContextManager] = \
            (lambda: torch.autocast(dev.type, dtype=dtype)) if dtype else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(dev.type, enabled=choice == "float16")

    @property
    def device(self) -> torch.device:
        return self.procs.device

    def wrap(self, core: nn.Module) -> nn.Module:
        """``core`` (already on the device) in its data-parallel form, the module training calls forward on.

        FSDP2 shards ``core`` in place (each block, then the rest), so its parameters become this rank's shards;
        DDP wraps it. ``core`` stays the module to evaluate, sample and checkpoint."""
        model: nn.Module = core
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for block in core.blocks:
                fully_shard(block)
            fully_shard(core)
        elif self.procs.distributed:
            from torch.nn.parallel import DistributedDataParallel

            # Buffers are not broadcast: the k-means statistics each rank gathers are its own until the
            # all-reduce of after_optimizer_step(), which keeps the centroids identical.
            model = DistributedDataParallel(
                core, device_ids=[self.procs.device.index] if self.procs.device.type == "cuda" else None,
                broadcast_buffers=False)
        return model

    def compiled(self, model: nn.Module) -> nn.Module:
        """``model`` compiled by torch.compile when the run asks for it (``compile``), else ``model``."""
        return torch.compile(model) if self.compile else model

    def full_state(self, core: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The whole model and optimizer states (sharded ones gathered to the CPU, every rank taking part)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (get_model_state_dict(core, options=options),
                    get_optimizer_state_dict(core, optimizer, options=options))
        return core.state_dict(), optimizer.state_dict()

    def load_optimizer_state(self, core: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """A whole optimizer state (as :meth:`full_state` returns it) into ``optimizer``, sharded if the model is."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(core, optimizer, state, options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(state)

    def describe(self) -> str:
        ddp = " with DDP" if self.procs.distributed and not self.sharded else ""
        return f"{self.procs.world} process(es){ddp} on {self.procs.device}, {self.precision}"
