"""Training: run configuration, and the trainer (trainer.py) put together from components with one job each: the
run directory (rundir.py), precision and parallelism (parallel.py, over distributed.py), the loop (loop.py),
evaluation (evaluation.py), checkpointing (checkpoint.py), stop signals (signals.py) and the sample (sampling.py)."""

from .config import RunConfig, TrainConfig
from .loading import load_run_config
from .signals import Diverged
from .trainer import Interrupted, TrainResult, executor_line, train

__all__ = ["Diverged", "Interrupted", "RunConfig", "TrainConfig", "TrainResult", "executor_line", "load_run_config",
           "train"]
