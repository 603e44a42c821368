"""Time the main job's training step through its own loop: ``routeformer train`` with the shipped configuration for
STEPS steps (the final scoring of the whole validation split replaced by the periodic estimate), then one line with
the median step after the first SKIP (which hold the kernels' and torch.compile's one-time costs).

Runs whichever routeformer is importable, so that two commits can be alternated on one machine, for example::

    PYTHONPATH=../old/src python scripts/main_step.py /tmp/a              # another checkout
    python scripts/main_step.py /tmp/b --set compile=false                # this one, eager

usage: main_step.py OUT_DIR [--steps N] [--skip K] [train arguments ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="run directory (a new one)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--skip", type=int, default=100)
    args, extra = parser.parse_known_args(argv)
    from routeformer.cli import main as cli
    from routeformer.train import loop
    from routeformer.train.evaluation import Validator

    Validator.whole_split = Validator.estimate  # type: ignore[method-assign]
    times: list[float] = []
    step = loop.Loop.step

    def timed(self, *a, **k):
        start = time.perf_counter()
        result = step(self, *a, **k)
        times.append(time.perf_counter() - start)
        return result

    loop.Loop.step = timed  # type: ignore[method-assign]
    rc = cli(["train", "--max-steps", str(args.steps), "--set", "decay_steps=6600", "--set", "eval_every=100000",
              "--set", "sample_tokens=0", "--set", "eval_tokens=1024", "--out", args.out, *extra])
    steady = sorted(times[args.skip:])
    if rc or not steady:
        print(f"RESULT failed (rc {rc}, {len(times)} steps)")
        return rc or 1
    print(f"RESULT median {statistics.median(steady) * 1e3:.2f} ms  q1 {steady[len(steady) // 4] * 1e3:.2f}  "
          f"q3 {steady[3 * len(steady) // 4] * 1e3:.2f}  first {times[0]:.1f} s  max {max(times):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
