"""Logs of a run: metrics.jsonl (one JSON object per line), optional TensorBoard / wandb, the loss-curve PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..durable import atomic_write


class MetricsLog:
    """Appends rows to run_dir/metrics.jsonl (flushed per line); mirrors them to TensorBoard / wandb when asked."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False, wandb_project: str | None = None,
                 config: dict | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - held open for the run, closed by close()
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("tensorboard = true needs the tensorboard package: pip install tensorboard") from None
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError("wandb = '...' needs the wandb package: pip install wandb") from None
            self._wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=config or {})

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        step = row.get("step", 0)
        for key, value in row.items():
            if key not in ("step", "split") and isinstance(value, (int, float)):
                name = f"{row.get('split', 'train')}/{key}"
                if self._tb is not None:
                    self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log({f"{row.get('split', 'train')}/{k}": v for k, v in row.items() if k != "split"},
                            step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl; a torn last line (a killed run) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows up to ``step`` (a resumed run rewrites what came after its checkpoint)."""
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def plot_losses(metrics_path: Path, png: Path, unit: str) -> bool:
    """The loss curve (train and validation, in ``unit``) as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["value"]) for r in rows if r.get("split") == "train" and "value" in r]
    valid = [(r["step"], r["value"]) for r in rows if r.get("split") == "valid" and "value" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train", lw=1, alpha=0.8)
    if valid:
        ax.plot(*zip(*valid, strict=True), label="validation", marker="o", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    finite = [v for _, v in train + valid if math.isfinite(v)]
    if finite and unit == "perplexity":
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(png, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    return True
