"""The run directory while training writes it: the checks before a run starts or resumes, config.toml, the metrics
log (metrics.jsonl, mirrored to TensorBoard / wandb when asked) and the loss curve. Rank 0 writes; the other
ranks only wait for it. Reading a run directory back is runs.py."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import torch.distributed as dist

from ..data import DataError, DatasetMeta
from ..durable import atomic_write
from .checkpoint import CHECKPOINT
from .config import RunConfig
from .distributed import Processes
from .metrics import MetricsLog, plot_losses, truncate_metrics

DATA_RECORD = "data.json"  # the name and split checksums of the data set a run trained on


def read_data_record(run_dir: Path) -> dict | None:
    """The run's data.json (None for a run that has none: it started before runs recorded their data)."""
    path = run_dir / DATA_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("sha256"), dict):
            raise ValueError("no sha256 table")
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is corrupt ({err})") from None
    return record


def data_changes(record: dict, meta: DatasetMeta) -> str:
    """What differs between a run's recorded data and ``meta`` ("" when nothing)."""
    changed = [f"{split}.bin" for split, digest in record["sha256"].items() if meta.sha256.get(split) != digest]
    return f"{', '.join(changed)} changed since the run started" if changed else ""


def new_run_dir(run: RunConfig, out: str | Path | None) -> Path:
    """``out``, or runs/<data>-<date>-<time>."""
    if out is not None:
        return Path(out).expanduser()
    return Path("runs") / f"{run.train.data}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


class RunDirectory:
    def __init__(self, path: Path, run: RunConfig, procs: Processes, resume: bool) -> None:
        self.path, self.run, self.procs, self.resume = path, run, procs, resume
        self.log: MetricsLog | None = None

    def prepare(self) -> None:
        """Refuse to start over a run (without --resume), create the directory and write config.toml."""
        if self.procs.main:
            if not self.resume and (self.path / CHECKPOINT).exists():
                raise ValueError(f"{self.path} already holds a run; continue it with --resume {self.path} or "
                                 f"choose another --out")
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ValueError(f"cannot create the run directory {self.path}: {err.strerror}") from None
            # Written on resume too: a changed --max-steps / --max-minutes holds for the next --resume as well.
            text = self.run.to_toml()
            atomic_write(self.path / "config.toml", lambda tmp: Path(tmp).write_text(text))
            if not self.resume:  # rows of an earlier start that died before its first checkpoint
                (self.path / "metrics.jsonl").unlink(missing_ok=True)
        if self.procs.distributed:
            dist.barrier()

    def record_data(self, meta: DatasetMeta) -> None:
        """A new run records the checksums of its data set (data.json); a resumed run refuses data that differs
        from them (its batches, and the validation it is compared on, would silently change)."""
        if not self.procs.main:
            return
        path = self.path / DATA_RECORD
        recorded = read_data_record(self.path)
        if self.resume and recorded is not None:
            changed = data_changes(recorded, meta)
            if changed:
                raise DataError(f"data set {meta.name!r} is not the one {self.path} trained on ({changed}); "
                                f"--resume refuses to go on with other data: prepare the original again or start "
                                f"a new run")
            return
        record = {"name": meta.name, "splits": meta.splits, "sha256": meta.sha256}
        text = json.dumps(record, indent=2) + "\n"
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))

    def open_log(self, step: int) -> None:
        """Open metrics.jsonl for appending (rank 0); a resumed run first drops the rows after its checkpoint's
        ``step``."""
        if not self.procs.main:
            return
        if self.resume:
            truncate_metrics(self.path / "metrics.jsonl", step)
        cfg = self.run.train
        self.log = MetricsLog(self.path, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb,
                              config={"model": vars(self.run.model), "train": vars(cfg)})

    def write(self, row: dict) -> None:
        """One row of metrics (rank 0; the other ranks write nothing)."""
        if self.log is not None:
            self.log.write(row)

    def plot(self, unit: str) -> Path | None:
        """loss.png from metrics.jsonl (rank 0); None elsewhere or without matplotlib."""
        png = self.path / "loss.png"
        if self.procs.main and plot_losses(self.path / "metrics.jsonl", png, unit):
            return png
        return None

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
