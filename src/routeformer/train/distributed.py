"""Processes under torchrun: one per GPU (NCCL) or per CPU worker (gloo); plain single-process otherwise."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..attention.routing.router import Router


@dataclass
class Processes:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``auto`` (this process's GPU, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; anything this machine cannot
    run on is a ValueError naming the device."""
    if device == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name (auto, cpu, cuda, cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: routeformer runs on cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this PyTorch sees no CUDA device (use cpu or auto)")
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return dev


def start(device: str = "auto") -> Processes:
    """Join the torchrun group when launched by torchrun (RANK / WORLD_SIZE set), choosing the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Processes(rank, world, local_rank, dev)


def stop(procs: Processes) -> None:
    """Wait for every rank (none may still be writing or reducing), then leave the group."""
    if procs.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def sum_all(values: list[float], procs: Processes) -> list[float]:
    """Element-wise sum over ranks (float64)."""
    if not procs.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=procs.device)
    dist.all_reduce(t)
    return t.tolist()


def routing_in_sync(model: nn.Module, procs: Processes) -> bool:
    """Every rank holds bit-identical routing state: every buffer of every router (centroids, EMA sums and counts,
    projections, the balancing bias and the warm-up count), pending statistics aside (each rank's own until the
    next step all-reduces them)."""
    if not procs.distributed:
        return True
    routers = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, Router))
    digest = hashlib.sha256()
    for name, buf in sorted(model.named_buffers()):
        routed = name.startswith(routers) or any(part in name for part in ("centroids", "ema_", "initialized"))
        if routed and "pending" not in name:
            digest.update(name.encode())
            digest.update(buf.detach().cpu().contiguous().numpy().tobytes())
    gathered: list[str | None] = [None] * procs.world
    dist.all_gather_object(gathered, digest.hexdigest())
    return len(set(gathered)) == 1
