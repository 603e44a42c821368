"""The ``routeformer`` command line."""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="routeformer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser("bench", help="benchmarks: time and peak memory tables")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    att = suites.add_parser(
        "attention",
        help="every attention pattern beside causal full attention",
        description="Forward and forward+backward time (median of consecutive runs after a warm-up) and peak "
        "memory of every attention pattern at each sequence length, beside causal full attention measured in the "
        "same run, and beside peer packages when installed (pip install -e '.[bench]').",
    )
    att.add_argument("--n", type=_positive, nargs="+", default=[1024, 4096, 16384], help="sequence lengths")
    att.add_argument("--batch", type=_positive, default=1)
    att.add_argument("--heads", type=_positive, default=8)
    att.add_argument("--head-dim", type=_positive, default=64)
    att.add_argument("--window", type=_positive, default=256, help="local / Longformer window")
    att.add_argument("--repeats", type=_positive, default=3, help="timed rounds (median reported)")
    att.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    att.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    att.add_argument("--non-causal", action="store_true", help="encoder (non-causal) variants")
    att.add_argument("--only", nargs="+", metavar="NAME", help="mechanisms to run beside full (e.g. local strided)")

    mod = suites.add_parser(
        "model",
        help="training throughput, memory and generation speed of full, local and local+routing models",
        description="Tokens per second and peak memory of a whole training step (forward, backward, AdamW step, "
        "k-means update) of three models of one size that differ only in attention (full, local, half local and "
        "half routing), and milliseconds per generated token after prompts of the given lengths.",
    )
    _model_arguments(mod)

    every = suites.add_parser("all", help="the attention benchmark, then the model benchmark (defaults)")
    every.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser


def _model_arguments(mod: argparse.ArgumentParser) -> None:
    mod.add_argument("--n", type=_positive, nargs="+", default=[1024, 4096, 8192], help="training lengths")
    mod.add_argument("--positions", type=_positive, nargs="+", default=[1024, 4096, 16384],
                     help="prompt lengths at which generation is timed")
    mod.add_argument("--dim", type=_positive, default=256)
    mod.add_argument("--depth", type=_positive, default=4)
    mod.add_argument("--heads", type=_positive, default=8)
    mod.add_argument("--window", type=_positive, default=256, help="local window")
    mod.add_argument("--batch", type=_positive, default=1)
    mod.add_argument("--repeats", type=_positive, default=3, help="timed training steps (median reported)")
    mod.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from .bench import attention, model

        if args.suite == "attention":
            attention.run(args.n, batch=args.batch, heads=args.heads, head_dim=args.head_dim, window=args.window,
                          repeats=args.repeats, device=args.device, dtype=DTYPES[args.dtype],
                          causal=not args.non_causal, only=args.only)
        elif args.suite == "model":
            model.run(args.n, args.positions, dim=args.dim, depth=args.depth, heads=args.heads, window=args.window,
                      batch=args.batch, repeats=args.repeats, device=args.device)
        else:
            attention.run([1024, 4096, 16384], device=args.device)
            print()
            model.run([1024, 4096, 8192], [1024, 4096, 16384], device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
