"""What the commands share: argument types, options that several commands take (each defined once), and the
parser class whose help texts state defaults."""

from __future__ import annotations

import argparse
import sys

import torch


def _integer(text: str, least: int, what: str) -> int:
    """An integer of at least ``least`` read from ``text``, or argparse's error saying it must be ``what``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive(text: str) -> int:
    """An argparse type: a positive integer."""
    return _integer(text, 1, "a positive integer")


def count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _integer(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """An argparse type: a positive number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def note(line: str) -> None:
    """An information line of a command (the attention banner: which executor runs, and why) on stderr, where the
    compiler's and the progress bars' lines go: stdout keeps the results (tables, scores, the sample's text)."""
    print(line, file=sys.stderr, flush=True)


# --- options that several commands share, each defined once ------------------------------------------------------
# Where commands word an option differently (what --data-dir is for, a suite's defaults), they pass the words.


def add_data(parser: argparse.ArgumentParser, help: str, default: str | None = None) -> None:
    parser.add_argument("--data", default=default, metavar="NAME", help=help)


def add_data_dir(parser: argparse.ArgumentParser, help: str = "where data sets live") -> None:
    parser.add_argument("--data-dir", metavar="DIR", help=help)


def add_overrides(parser: argparse.ArgumentParser, help: str = "override a [model] or [train] field (repeatable), "
                   "e.g. --set dim=512 --set lr=3e-4") -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_out(parser: argparse.ArgumentParser, help: str, default: str | None = None, metavar: str = "RUN_DIR") -> None:
    parser.add_argument("--out", default=default, metavar=metavar, help=help)


def add_run_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by routeformer train")


def add_checkpoint(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", choices=("best", "last"), default="best",
                        help="the best (lowest validation loss) or the last weights")


def add_device(parser: argparse.ArgumentParser, *, bench: bool = False) -> None:
    """Commands that use a run: ``auto``, any device name. Benchmarks: cpu or cuda, cuda when there is a GPU."""
    if bench:
        parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                            help="cpu or cuda (default: cuda when there is a GPU)")
    else:
        parser.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda or cuda:N")


def add_backend(parser: argparse.ArgumentParser) -> None:
    from ..executors import EXECUTORS

    parser.add_argument("--backend", choices=["auto", *EXECUTORS], default="auto",
                        help="executor of the patterns: auto (FlexAttention on CUDA, the fused kernels on the CPU), "
                             f"{', '.join(EXECUTORS)}")


def add_lengths(parser: argparse.ArgumentParser, default: list[int], help: str) -> None:
    parser.add_argument("--n", type=positive, nargs="+", default=default, help=help)


def add_seq_len(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    parser.add_argument("--seq-len", type=positive, default=default, help=f"{help} (default {default})")


def add_attention_specs(parser: argparse.ArgumentParser, default: list[str], help: str) -> None:
    parser.add_argument("--attention", nargs="+", default=default, metavar="SPEC", help=help)


def add_size(parser: argparse.ArgumentParser, flag: str, default: int, help: str) -> None:
    """--dim, --depth, --heads, --batch, --repeats, --steps: a positive count, its default named in the help."""
    parser.add_argument(flag, type=positive, default=default, help=f"{help} (default {default})")


def add_window(parser: argparse.ArgumentParser, default: int | None, help: str = "local window") -> None:
    parser.add_argument("--window", type=positive, default=default,
                        help=help if default is None else f"{help} (default {default})")


def add_routing_sizes(parser: argparse.ArgumentParser, length: str) -> None:
    """--num-clusters and --routing-window, whose defaults follow the sequence length ``length``."""
    parser.add_argument("--num-clusters", type=positive, help=f"routing k (default round(sqrt({length})))")
    parser.add_argument("--routing-window", type=positive,
                        help=f"routing keys per probed cluster (default {length} // (k · probes))")


class HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already speaks of it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default in (None, False, argparse.SUPPRESS)
                or isinstance(default, (list, tuple)) and not default):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """The command line's parsers (sub-commands inherit the class): help texts that state defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpWithDefaults)
        super().__init__(*args, **kwargs)
