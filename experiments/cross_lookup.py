"""Issue 73's synthetic task: can routing cross-attention find a value by its key's content? (``bench/lookup.py``)

    python experiments/cross_lookup.py [--pairs 16] [--steps 1500] [--seeds 0,1]
        [--cross full:4 --cross routing:4 ...] [--clusters 4] [--probes 1] [--commitment 1e-4] [--decay 0.999]
        [--warmup 0] [--window W] [--json OUT.json]

Each --cross spec trains a fresh model (dim 64, 4 heads, one encoder and one decoder layer of full self-attention,
token shift 'half', absolute positions, AdamW 2e-3, batch 32 of fresh pairs) for --steps steps per seed, and prints
the answers' accuracy on held-out batches (chance 1/32) beside the keys a routing query reads (2 sqrt(Nk) is the
goal's bound). The routing options apply to every routing spec. The runs and what they showed: docs/model.md,
"The lookup task".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from routeformer.bench.lookup import run_lookup
from routeformer.model.seq2seq import Seq2SeqConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--cross", action="append", help="a cross spec (repeat; default full:4 and routing:4)")
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--probes", type=int, default=1)
    parser.add_argument("--commitment", type=float, default=1e-4)
    parser.add_argument("--decay", type=float, default=0.999)
    parser.add_argument("--warmup", type=int, default=0, help="steps of full cross-attention before routing")
    parser.add_argument("--window", type=int, default=None, help="keys a probe reads (default ceil(Nk / clusters))")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    memory = 2 * args.pairs
    routing = {"num_clusters": args.clusters, "probes": args.probes, "commitment": args.commitment,
               "decay": args.decay, "warmup": args.warmup, "window": args.window}
    common = dict(vocab_size=256, dim=64, heads=4, positions="absolute", token_shift="half")
    rows = []
    print(f"lookup: {args.pairs} pairs (Nk = {memory}; 2 sqrt(Nk) = {2 * math.sqrt(memory):.1f}), {args.steps} steps, "
          f"seeds {seeds}; routing {routing}")
    print("cross                keys a query  accuracy (per seed)        mean   seconds a run")
    for cross in args.cross or ["full:4", "routing:4"]:
        config = Seq2SeqConfig(encoder=dict(common, depth=1, seq_len=memory, attention="full"),
                               decoder=dict(common, depth=1, seq_len=memory, attention="full"), cross=cross,
                               cross_options={"routing": routing} if "routing" in cross else {})
        runs = [run_lookup(config, pairs=args.pairs, steps=args.steps, batch=32, lr=2e-3, seed=s) for s in seeds]
        window = math.ceil(memory / args.clusters) if args.window is None else min(memory, args.window)
        keys = memory if "routing" not in cross else args.probes * window
        accuracy = [r.accuracy for r in runs]
        rows.append({"cross": cross, "keys": keys, "accuracy": accuracy, "routing": routing, "steps": args.steps,
                     "pairs": args.pairs, "seconds": [r.seconds for r in runs]})
        print(f"{cross:<20} {keys:>12}  {' '.join(f'{a:.3f}' for a in accuracy):<25} "
              f"{statistics.mean(accuracy):.3f}  {statistics.mean(r.seconds for r in runs):>13.0f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
