"""The median training step time of the shipped default model at another length and attention, alone:

    OMP_NUM_THREADS=1 python experiments/step_time.py 2048 local
    OMP_NUM_THREADS=1 python experiments/step_time.py 2048 "local:2,routing:2" options.routing.probes=1

argv: seq_len, the attention spec, then any ``--set`` style overrides (routing: k = round(sqrt(N)) and N / k keys
per probe unless overridden). The model benchmark's step (``bench.model.train_step``) with the training loop's
optimizer; the median of ``REPS`` (default 5) steps after 2 warm-up steps (``bench.measure.median_time``). For the
text study's equal-time comparisons: run it with nothing else running.
"""

from __future__ import annotations

import os
import sys

import torch

from routeformer import TransformerLM
from routeformer.bench.measure import median_time
from routeformer.bench.model import train_step
from routeformer.train import load_run_config
from routeformer.train.loop import adamw


def main(argv: list[str]) -> None:
    n, attention = int(argv[0]), argv[1]
    k = round(n ** 0.5)
    sets = [f"seq_len={n}", f"attention={attention!r}", f"options.routing.num_clusters={k}",
            f"options.routing.window={n // k}", *argv[2:]]
    run = load_run_config(None, sets)
    torch.manual_seed(0)
    model = TransformerLM(run.model).train()
    tokens = torch.randint(0, 256, (run.train.batch_size, n + 1))
    step = train_step(model, adamw(model, run.train), tokens)  # the model benchmark's step, the loop's optimizer
    step()  # one more warm-up step than median_time's own
    repeats = int(os.environ.get("REPS", "5"))
    seconds = median_time(step, repeats, "cpu")
    print(f"{attention} N={n}: {seconds:.3f} s/step, median of {repeats} (threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main(sys.argv[1:])
