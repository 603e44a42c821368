"""Processes under torchrun: one per GPU (NCCL) or per CPU worker (gloo), in a process group even when torchrun
starts one (so that a one-GPU run wraps the model in DDP or FSDP2 as a larger one does); plain single-process
otherwise."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..model import TransformerLM


@dataclass
class Processes:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    launched: bool = False  # started by torchrun: in a process group, even alone

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether the processes form a process group (torchrun, any number of them): the model is wrapped in DDP
        or FSDP2 and the ranks reduce and compare through ``torch.distributed``."""
        return self.launched or self.world > 1


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


def launched_by_torchrun() -> bool:
    """Whether torchrun started this process (it sets TORCHELASTIC_RUN_ID, and LOCAL_RANK and WORLD_SIZE), whatever
    the number of processes."""
    return "TORCHELASTIC_RUN_ID" in os.environ or {"LOCAL_RANK", "WORLD_SIZE"} <= os.environ.keys()


def start(device: str = "auto") -> Processes:
    """Join the torchrun group when launched by torchrun (one process included: NCCL on CUDA, gloo on the CPU),
    choosing the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    procs = Processes(rank, world, local_rank, dev, launched=launched_by_torchrun())
    if procs.distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return procs


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


def routing_in_sync(model: TransformerLM, procs: Processes) -> bool:
    """Every rank holds bit-identical routing state (``TransformerLM.replicated_state``: every buffer of every
    router, centroids, EMA sums and counts, projections, the balancing bias and the warm-up count), pending
    statistics aside (each rank's own until the next step all-reduces them)."""
    if not procs.distributed:
        return True
    digest = hashlib.sha256()
    for name, buf in sorted(model.replicated_state().items()):
        digest.update(name.encode())
        # the raw bytes, whatever the dtype (numpy has no bfloat16)
        digest.update(buf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    gathered: list[str | None] = [None] * procs.world
    dist.all_gather_object(gathered, digest.hexdigest())
    return len(set(gathered)) == 1
