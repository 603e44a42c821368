"""The median training step time of the shipped default model at another length and attention, alone:

    OMP_NUM_THREADS=1 python experiments/step_time.py 2048 local
    OMP_NUM_THREADS=1 python experiments/step_time.py 2048 "local:2,routing:2" options.routing.probes=1

argv: seq_len, the attention spec, then any ``--set`` style overrides (routing: k = round(sqrt(N)) and N / k keys
per probe unless overridden). The library's own model and optimizer; the median of ``REPS`` (default 5) steps after
2 warm-up steps. For the text study's equal-time comparisons: run it with nothing else running.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

from routeformer import TransformerLM
from routeformer.train import loop
from routeformer.train.config import load_run_config


def main(argv: list[str]) -> None:
    n, attention = int(argv[0]), argv[1]
    k = round(n ** 0.5)
    sets = [f"seq_len={n}", f"attention={attention!r}", f"options.routing.num_clusters={k}",
            f"options.routing.window={n // k}", *argv[2:]]
    run = load_run_config(None, sets)
    torch.manual_seed(0)
    model = TransformerLM(run.model).train()
    optimizer = loop.adamw(model, run.train)
    tokens = torch.randint(0, 256, (run.train.batch_size, n + 1))

    def step(i: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss.float()
        loss.backward()
        optimizer.step()
        model.after_optimizer_step(i)

    for i in range(2):
        step(i + 1)
    times = []
    for i in range(int(os.environ.get("REPS", "5"))):
        start = time.perf_counter()
        step(i + 3)
        times.append(time.perf_counter() - start)
    print(f"{attention} N={n}: {sorted(times)[len(times) // 2]:.3f} s/step, median of {len(times)} "
          f"(threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main(sys.argv[1:])
