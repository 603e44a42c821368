"""The ``routeformer`` command line: prepare | train | evaluate | sample | analyze | bench | env.

Each command is a module of this package with ``add_parser`` (its sub-parser) and ``cmd_<name>`` (its handler);
``COMMANDS`` maps a command's name to its handler, which ``main`` looks up when it runs.

Errors in what the user gave (files, options, data) are one line on stderr and exit status 2; set
ROUTEFORMER_DEBUG=1 to see the traceback. An interrupted training run exits with status 130 after saving.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from .. import hugepages
from . import analyze, bench, env, evaluate, prepare, sample, train
from .options import Parser

# in the order `routeformer --help` lists them
MODULES = (prepare, train, evaluate, sample, analyze, bench, env)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "prepare": prepare.cmd_prepare, "train": train.cmd_train, "evaluate": evaluate.cmd_evaluate,
    "sample": sample.cmd_sample, "analyze": analyze.cmd_analyze, "bench": bench.cmd_bench, "env": env.cmd_env}


def build_parser() -> argparse.ArgumentParser:
    """The whole command line's parser: one sub-parser per command."""
    from .. import __version__

    parser = Parser(
        prog="routeformer", description="Long-sequence Transformers with routing attention: prepare data, train, "
        "evaluate, sample, benchmark; env describes this installation.")
    parser.add_argument("--version", action="version", version=f"routeformer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in MODULES:
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command ``argv`` (default: this process's arguments) names; returns the exit status."""
    hugepages.request()  # before the first tensor: PyTorch reads it once
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves and stops on its own)
        if os.environ.get("ROUTEFORMER_DEBUG"):
            raise
        print(f"\nrouteformer: {args.command} interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # user-facing failures: one line, no traceback
        from ..data import DataError

        if os.environ.get("ROUTEFORMER_DEBUG") or not isinstance(err, (ValueError, DataError, OSError)):
            raise
        print(f"routeformer: error: {err}", file=sys.stderr)
        return 2
