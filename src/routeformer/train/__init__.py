"""Training: run configuration, the loop, checkpoints, distributed processes, evaluation, metrics."""

from .config import RunConfig, TrainConfig, load_run_config
from .trainer import Interrupted, TrainResult, train

__all__ = ["Interrupted", "RunConfig", "TrainConfig", "TrainResult", "load_run_config", "train"]
