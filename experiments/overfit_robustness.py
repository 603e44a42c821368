"""How robust is the overfit test's verdict? Train its tiny model from the seeded initial weights multiplied by
(1 + 1e-6 · noise), for several noise seeds, and count the final losses over the test's threshold (0.05).

A verdict that one processor's rounding can flip shows up here as a share of failing perturbations on every
machine. Used for issue 22 (numbers in the closing note and in tests/test_model.py's ``overfit``):

    python experiments/overfit_robustness.py --spec routing --separate --runs 20 --steps 400 --num-clusters 3 \
        --routing-window 6
    python experiments/overfit_robustness.py --spec routing --separate --runs 20 --steps 400 --num-clusters 2 \
        --routing-window 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_model import overfit  # noqa: E402 - the test's own training, so the experiment measures the test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="routing", help="attention spec (default routing)")
    parser.add_argument("--separate", action="store_true", help="separate query and key routing")
    parser.add_argument("--runs", type=int, default=20, help="perturbations (default 20)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300, the test's)")
    parser.add_argument("--num-clusters", type=int, default=2, help="routing k (default 2)")
    parser.add_argument("--routing-window", type=int, default=16, help="routing keys per query (default 16)")
    parser.add_argument("--threshold", type=float, default=0.05, help="the test's threshold (default 0.05)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kw = {"shared_qk": False, "separate": True} if args.separate else (  # options.routing settings
        {"shared_qk": False} if args.spec == "routing" else {})
    start = time.time()
    losses = sorted(overfit(args.spec, kw, p, steps=args.steps, num_clusters=args.num_clusters,
                            routing_window=args.routing_window) for p in range(100, 100 + args.runs))
    failing = sum(loss > args.threshold for loss in losses)
    print(f"{args.spec} {kw}: k={args.num_clusters}, window={args.routing_window}, {args.steps} steps: "
          f"{failing} of {args.runs} over {args.threshold}; worst {', '.join(f'{x:.3f}' for x in losses[-4:])} "
          f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
