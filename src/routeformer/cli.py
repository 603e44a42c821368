"""The ``routeformer`` command line: prepare | train | evaluate | sample | analyze | bench.

Errors in what the user gave (files, options, data) are one line on stderr and exit status 2; set
ROUTEFORMER_DEBUG=1 to see the traceback. An interrupted training run exits with status 130 after saving.
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


# --- options that several commands share, each defined once ------------------------------------------------------
# Where commands word an option differently (what --data-dir is for, a suite's defaults), they pass the words.


def _add_data(parser: argparse.ArgumentParser, help: str, default: str | None = None) -> None:
    parser.add_argument("--data", default=default, metavar="NAME", help=help)


def _add_data_dir(parser: argparse.ArgumentParser, help: str = "where data sets live") -> None:
    parser.add_argument("--data-dir", metavar="DIR", help=help)


def _add_overrides(parser: argparse.ArgumentParser, help: str = "override a [model] or [train] field (repeatable), "
                   "e.g. --set dim=512 --set lr=3e-4") -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def _add_out(parser: argparse.ArgumentParser, help: str, default: str | None = None, metavar: str = "RUN_DIR") -> None:
    parser.add_argument("--out", default=default, metavar=metavar, help=help)


def _add_run_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by routeformer train")


def _add_checkpoint(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", choices=("best", "last"), default="best",
                        help="the best (lowest validation loss) or the last weights")


def _add_device(parser: argparse.ArgumentParser, *, bench: bool = False) -> None:
    """Commands that use a run: ``auto``, any device name. Benchmarks: cpu or cuda, cuda when there is a GPU."""
    if bench:
        parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                            help="cpu or cuda (default: cuda when there is a GPU)")
    else:
        parser.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda or cuda:N")


def _add_backend(parser: argparse.ArgumentParser) -> None:
    from .attention.executors import EXECUTORS

    parser.add_argument("--backend", choices=["auto", *EXECUTORS], default="auto",
                        help="executor of the patterns: auto (FlexAttention on CUDA, the fused kernels on the CPU), "
                             f"{', '.join(EXECUTORS)}")


def _add_lengths(parser: argparse.ArgumentParser, default: list[int], help: str) -> None:
    parser.add_argument("--n", type=_positive, nargs="+", default=default, help=help)


def _add_seq_len(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    parser.add_argument("--seq-len", type=_positive, default=default, help=f"{help} (default {default})")


def _add_attention_specs(parser: argparse.ArgumentParser, default: list[str], help: str) -> None:
    parser.add_argument("--attention", nargs="+", default=default, metavar="SPEC", help=help)


def _add_size(parser: argparse.ArgumentParser, flag: str, default: int, help: str) -> None:
    """--dim, --depth, --heads, --batch, --repeats, --steps: a positive count, its default named in the help."""
    parser.add_argument(flag, type=_positive, default=default, help=f"{help} (default {default})")


def _add_window(parser: argparse.ArgumentParser, default: int | None, help: str = "local window") -> None:
    parser.add_argument("--window", type=_positive, default=default,
                        help=help if default is None else f"{help} (default {default})")


def _add_routing_sizes(parser: argparse.ArgumentParser, length: str) -> None:
    """--num-clusters and --routing-window, whose defaults follow the sequence length ``length``."""
    parser.add_argument("--num-clusters", type=_positive, help=f"routing k (default round(sqrt({length})))")
    parser.add_argument("--routing-window", type=_positive,
                        help=f"routing keys per probed cluster (default {length} // (k · probes))")


PROMPT_END = "⟫"  # printed where a run's final sample turns from its prompt to the model's continuation


class _HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already speaks of it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default in (None, False, argparse.SUPPRESS)
                or isinstance(default, (list, tuple)) and not default):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """The command line's parsers (sub-commands inherit the class): help texts that state defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpWithDefaults)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .data import PREPARERS

    parser = _Parser(
        prog="routeformer", description="Long-sequence Transformers with routing attention: prepare data, train, "
        "evaluate, sample, benchmark.")
    parser.add_argument("--version", action="version", version=f"routeformer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prep = commands.add_parser(
        "prepare", help="turn a data set into train/valid/test token arrays",
        description="Prepare a data set once into memory-mapped train.bin / valid.bin / test.bin and meta.json "
        "under DATA_DIR/NAME. stdlib: this Python's standard library (no download); sympy: the installed SymPy's "
        "sources of at least 16 KiB, long documents (no download); enwik8, text8: downloaded "
        "from mattmahoney.net or taken from --from (md5 checked); wikitext103: downloaded or --from (the "
        "wikitext-103-v1 zip or its folder); imagenet64: --from a folder of the 64x64 npz batches; text: --from a "
        "text file or folder.")
    prep.add_argument("name", choices=sorted(PREPARERS), metavar="NAME", help=f"one of {', '.join(PREPARERS)}")
    prep.add_argument("--from", dest="source", metavar="PATH", help="a local archive, file or folder to use")
    _add_data_dir(prep, "where data sets live (default ~/.cache/routeformer, or $ROUTEFORMER_DATA)")
    prep.add_argument("--name", dest="dataset_name", metavar="NAME", help="store under this name (for text data)")
    prep.add_argument("--skip-checksum", action="store_true", help="accept enwik8 / text8 whose md5 is not the "
                      "published one")
    prep.add_argument("--force", action="store_true", help="replace a data set of the same name whose content "
                      "differs (default: refuse; runs trained on it would be scored on the new data)")

    tr = commands.add_parser(
        "train", help="train a model (with no arguments: the main job on stdlib)",
        description="Train a model from a TOML configuration ([model] and [train] tables; default: the shipped "
        "default.toml, a half-local half-routing byte model trained on stdlib in about ten minutes on 2 CPU "
        "cores). Under torchrun, one process per GPU (or CPU worker) trains data-parallel. Ctrl-C saves a "
        "checkpoint and exits; --resume continues it exactly.")
    tr.add_argument("--config", metavar="FILE", help="a TOML file, or a shipped name: default, enwik8, "
                    "wikitext103, imagenet64")
    _add_data(tr, "data set to train on (overrides [train] data)")
    _add_data_dir(tr)
    _add_overrides(tr)
    _add_out(tr, "run directory (default runs/<data>-<date>-<time>)")
    tr.add_argument("--max-steps", type=_positive, metavar="S",
                    help="train to optimiser step S (counted from the run's start; the cosine decay ends there, or "
                    "when the time budget runs out first, unless decay_steps is set)")
    tr.add_argument("--max-minutes", type=_positive_float, metavar="M",
                    help="stop after M minutes of this invocation (then evaluate and save)")
    tr.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint (only "
                    "--max-steps and --max-minutes may change)")
    tr.add_argument("--fsdp", action="store_true", help="shard parameters with FSDP2 instead of DDP (torchrun)")

    ev = commands.add_parser(
        "evaluate", help="bits per byte / perplexity / bits per dimension of a run on a split",
        description="Evaluate a run's weights over a whole split in windows of seq_len: bits per byte (byte "
        "data), perplexity (words) or bits per dimension (images). Runs data-parallel under torchrun.")
    _add_run_dir(ev)
    ev.add_argument("--split", choices=("valid", "test"), default="valid", help="the split to score (default "
                    "valid)")
    _add_checkpoint(ev)
    ev.add_argument("--stride", type=_positive, metavar="S", help="advance windows by S < seq_len and score only "
                    "their last S tokens, so every token has at least seq_len - S of context (default: "
                    "non-overlapping windows)")
    ev.add_argument("--batch-size", type=_positive, default=8, metavar="B", help="windows per forward (default 8)")
    _add_data_dir(ev, "where the run's data set lives, if not where it was trained")
    _add_device(ev)

    sa = commands.add_parser(
        "sample", help="generate text from a run, streamed as it is produced",
        description="Continue a prompt with a run's model through its cached generation, printing the text as it "
        "is generated.")
    _add_run_dir(sa)
    src = sa.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    src.add_argument("--prompt-file", metavar="FILE", help="read the text to continue from FILE")
    sa.add_argument("--tokens", type=_positive, default=300, metavar="N", help="tokens to generate")
    sa.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 for greedy")
    sa.add_argument("--top-k", type=_positive, metavar="K", help="sample among the K most likely tokens")
    sa.add_argument("--top-p", type=_positive_float, metavar="P",
                    help="sample among the most likely tokens whose probabilities sum to P (nucleus, 0 < P <= 1)")
    sa.add_argument("--seed", type=int, metavar="S", help="make the sample repeatable")
    _add_checkpoint(sa)
    _add_data_dir(sa, "where the run's data set lives (for its vocabulary), if not where it was trained")
    _add_device(sa)

    _add_analyze(commands)

    bench = commands.add_parser(
        "bench", help="benchmarks: time and peak memory tables",
        description="Benchmarks that print tables: 'attention' (time and memory of every pattern beside full "
        "attention), 'model' (training and generation of models that differ only in attention), 'recall' "
        "(long-range retrieval accuracy of trained models), 'text' (bits per byte on real text at equal time), "
        "'all' (attention, then model).")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    att = suites.add_parser(
        "attention",
        help="every attention pattern beside causal full attention",
        description="Forward and forward+backward time (median of consecutive runs after a warm-up) and peak "
        "memory of every attention pattern at each sequence length, beside causal full attention measured in the "
        "same run, and beside peer packages when installed (pip install -e '.[bench]').",
    )
    _add_lengths(att, [1024, 4096, 16384], "sequence lengths")
    _add_size(att, "--batch", 1, "batch size B")
    _add_size(att, "--heads", 8, "heads H")
    _add_size(att, "--head-dim", 64, "head size D")
    _add_window(att, 256, "local / Longformer window")
    _add_size(att, "--repeats", 3, "timed rounds, median reported")
    _add_device(att, bench=True)
    att.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="tensor dtype (default float32)")
    att.add_argument("--non-causal", action="store_true", help="encoder (non-causal) variants")
    _add_backend(att)
    att.add_argument("--only", nargs="+", metavar="NAME",
                     help="mechanisms to run beside full, with their peers (e.g. local strided lsh performer)")

    mod = suites.add_parser(
        "model",
        help="training throughput, memory and generation speed of full, local and local+routing models",
        description="Tokens per second and peak memory of a whole training step (forward, backward, AdamW step, "
        "k-means update) of three models of one size that differ only in attention (full, local, half local and "
        "half routing), and milliseconds per generated token after prompts of the given lengths.",
    )
    _add_lengths(mod, [1024, 4096, 8192], "training lengths")
    mod.add_argument("--positions", type=_positive, nargs="+", default=[1024, 4096, 16384],
                     help="prompt lengths at which generation is timed")
    _add_size(mod, "--dim", 256, "model width")
    _add_size(mod, "--depth", 4, "layers")
    _add_size(mod, "--heads", 8, "heads per layer")
    _add_window(mod, 256)
    from .bench import model as bench_model  # the row names (this imports nothing beyond the package)

    mod.add_argument("--models", nargs="+", metavar="NAME", default=list(bench_model.MODELS),
                     help="rows: attention specs ('full', 'local:4,routing:4') or presets "
                     f"({', '.join(bench_model.PRESETS)}); the first is the baseline (default: %(default)s)")
    _add_size(mod, "--batch", 1, "sequences per training step")
    _add_size(mod, "--repeats", 3, "timed training steps, median reported")
    _add_device(mod, bench=True)
    _add_backend(mod)

    rec = suites.add_parser(
        "recall",
        help="long-range recall: accuracy of full, local and local+routing models trained on synthetic tasks",
        description="Trains one small model per (task, attention) for a fixed number of steps on recall tasks "
        "generated on the fly (multi-query associative recall, passkey, two-hop recall), each with a gap longer "
        "than depth × window so that local-only attention stays at chance, and prints accuracy, chance, seconds "
        "per step, keys scored per query and what the routing heads reached (cluster balance, needed key in the "
        "query's cluster, in its window).",
    )
    rec.add_argument("--tasks", nargs="+", default=["mqar", "passkey", "two_hop"], metavar="TASK",
                     help="mqar, passkey, two_hop, latest (default: the first three)")
    _add_attention_specs(rec, ["full", "local", "local+routing"],
                         "full, local, local+routing (half and half) or any attention spec (local:2,routing:2); "
                         "a suffix /shared, /joint or /separate says how routing heads route, and '@field=value' "
                         "suffixes set model config fields for the row (local+routing@options.routing.probes=1); the "
                         "first row is the baseline of the 'vs first' column (default: full local local+routing)")
    _add_seq_len(rec, 128, "sequence length N")
    rec.add_argument("--gap", type=_positive, default=32, help="positions between an answer and what it needs "
                     "are more than this (default 32; at least depth × (window - 1))")
    _add_size(rec, "--facts", 4, "mqar: facts per sequence, each with its own key")
    _add_size(rec, "--depth", 2, "layers")
    _add_size(rec, "--dim", 64, "model width")
    _add_size(rec, "--heads", 4, "heads per layer")
    _add_window(rec, 8)
    _add_routing_sizes(rec, "N")
    _add_size(rec, "--steps", 800, "training steps per model")
    _add_size(rec, "--batch", 32, "sequences per step")
    rec.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    rec.add_argument("--eval", type=_positive, default=512, help="held-out sequences scored (default 512)")
    rec.add_argument("--seeds", type=int, nargs="+", default=[0], metavar="SEED",
                     help="model initialisation seeds: every row trains once per seed and reports the mean "
                     "(default 0)")

    txt = suites.add_parser(
        "text",
        help="validation bits per byte of local, local+routing and full models at one budget",
        description="Trains one model per attention with the shipped default configuration (data set, width, "
        "schedule) at the given context and wall-clock budget, and prints each one's bits per byte on the whole "
        "validation split.",
    )
    _add_attention_specs(txt, ["local", "local+routing", "full"],
                         "as for bench recall (default: local local+routing full)")
    _add_seq_len(txt, 1024, "context")
    txt.add_argument("--minutes", type=float, default=4.0, help="training budget per model (default 4)")
    _add_size(txt, "--steps", 2000, "steps of the cosine schedule")
    _add_window(txt, None, "local window (default: the configuration's, 128)")
    _add_routing_sizes(txt, "seq_len")
    _add_data(txt, "data set (default stdlib)", default="stdlib")
    _add_data_dir(txt)
    _add_out(txt, "where the run directories go", default="runs/bench-text", metavar="DIR")
    _add_overrides(txt, "override a [model] or [train] field for every row")

    every = suites.add_parser("all", help="the attention benchmark, then the model benchmark (defaults)",
                              description="Run 'bench attention' and then 'bench model', each with its defaults.")
    _add_device(every, bench=True)
    return parser


def _add_analyze(commands) -> None:
    an = commands.add_parser(
        "analyze", help="what approximations lose, how heads differ, what routing attends to",
        description="Analyse a trained run on a split of its data: 'approximations' replaces every head's output "
        "by sparse or approximate attention (the value-aware study); 'heads' measures the Jensen-Shannon "
        "divergence between heads (the routing paper's Table 4); 'patterns' draws which inputs each output "
        "attends to (its Figure 1) and the routing heads' cluster statistics; 'routing' shows what the routing "
        "heads use and where they beat a local model. Writes text, CSV and PNG files to "
        "RUN_DIR/analysis (or --out) and prints their paths.")
    _add_run_dir(an)
    kinds = an.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    approx = kinds.add_parser("approximations", help="metric with every head replaced by each approximation",
                              description="Evaluate the run with the output of every attention head (of --layers) "
                              "replaced by: exact, optimal-v-oblivious-r (ovo), optimal-v-aware-r (ova), "
                              "sliding-window-r, LSH-r and random features with r features.")
    approx.add_argument("--methods", default="ovo,ova,sliding,lsh,features",
                        help="comma-separated, from exact, ovo, ova, sliding, lsh, features (default all; exact "
                        "always runs)")
    approx.add_argument("--r", default=None, metavar="R1,R2,...",
                        help="keys per query (features for random features); default 1,2,4,8,16,D+1")
    approx.add_argument("--windows", type=_positive, default=32, metavar="W",
                        help="evenly spaced windows of seq_len tokens to score (default 32)")
    approx.add_argument("--all-windows", action="store_true", help="score the whole split")
    approx.add_argument("--lsh-rounds", type=_positive, default=1, help="LSH hash rounds (default 1)")
    approx.add_argument("--seed", type=int, default=0, help="seed of the LSH rotations and random features")
    hd = kinds.add_parser("heads", help="Jensen-Shannon divergence between the heads of each layer",
                          description="The mean Jensen-Shannon divergence between the attention distributions of "
                          "every pair of heads in each layer (the routing paper's Table 4), over --batches "
                          "batches of the split.")
    pat = kinds.add_parser("patterns", help="Figure-1 pictures of a layer's heads and routing cluster statistics",
                           description="Pictures of which inputs each output of a layer's heads attends to (the "
                           "routing paper's Figure 1), and the routing heads' cluster sizes and balance.")
    pat.add_argument("--layer", type=int, default=0, help="the layer to draw (default 0)")
    pat.add_argument("--head", type=int, help="one head of the layer (default: every head)")
    text = pat.add_mutually_exclusive_group()
    text.add_argument("--text", metavar="TEXT", help="the text to draw (default: the split's first window)")
    text.add_argument("--text-file", metavar="FILE", help="read the text to draw from FILE")
    pat.add_argument("--length", type=_positive, metavar="N", help="draw the first N tokens (default seq_len)")
    rt = kinds.add_parser("routing", help="what the routing heads use: mass beyond the local window, distances, "
                          "the most-attended far pairs, and where routing's loss beats a baseline's",
                          description="The routing heads' attention on --windows windows of the split: the share of "
                          "their mass beyond the model's local window, the mass by distance, the --top most-attended "
                          "pairs beyond the local window printed as text with whether the --context tokens ending "
                          "at query and key match; with --baseline RUN (a local model on the same data and length), "
                          "the per-token loss of both by the distance to the previous occurrence of the last "
                          "--context tokens (a table, a CSV and a figure).")
    rt.add_argument("--baseline", metavar="RUN_DIR", help="a run to compare per-token losses with (a local model)")
    rt.add_argument("--windows", type=_positive, default=16, help="windows of seq_len tokens to analyse (default 16)")
    rt.add_argument("--top", type=_positive, default=100, help="the most-attended far pairs to print (default 100)")
    rt.add_argument("--context", type=_positive, default=8, help="tokens that make a context (default 8)")
    rt.add_argument("--local-window", type=_positive, metavar="W",
                    help="the distance from which a key counts as far (default the model's local window)")
    for sub in (approx, hd, pat, rt):
        sub.add_argument("--split", choices=("valid", "test"), default="valid", help="the split (default valid)")
        sub.add_argument("--batch-size", type=_positive, default=4 if sub is not approx else 8, metavar="B",
                         help="windows per forward")
        _add_checkpoint(sub)
        _add_data_dir(sub, "where the run's data set lives, if not where it was trained")
        _add_device(sub)
        sub.add_argument("--out", metavar="DIR", help="where to write (default RUN_DIR/analysis)")
    for sub in (approx, hd):
        sub.add_argument("--layers", metavar="L1,L2,...", help="only these layers (default all)")
    for sub in (hd, pat):
        sub.add_argument("--batches", type=_positive, default=4, help="batches of windows for the statistics "
                         "(default 4)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves and stops on its own)
        if os.environ.get("ROUTEFORMER_DEBUG"):
            raise
        print(f"\nrouteformer: {args.command} interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # user-facing failures: one line, no traceback
        from .data import DataError

        if os.environ.get("ROUTEFORMER_DEBUG") or not isinstance(err, (ValueError, DataError, OSError)):
            raise
        print(f"routeformer: error: {err}", file=sys.stderr)
        return 2


def cmd_prepare(args) -> int:
    import numpy as np

    from .data import default_data_dir, prepare

    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    meta = prepare(args.name, data_dir, args.source, dataset_name=args.dataset_name,
                   skip_checksum=args.skip_checksum, force=args.force)
    where = data_dir / meta.name
    print(f"prepared {meta.name} in {where}: " + ", ".join(f"{s} {n:,}" for s, n in meta.splits.items())
          + f" tokens; vocabulary {meta.vocab_size:,}; metric {meta.metric}")
    if meta.kind == "bytes":  # two reference points a model should beat
        import zlib

        from .data import Dataset

        data = Dataset.open(meta.name, data_dir, verify=False)
        counts = np.bincount(np.asarray(data.split("train")), minlength=256)
        p = counts[counts > 0] / counts.sum()
        valid = np.asarray(data.split("valid")).tobytes()
        print(f"reference points: order-0 entropy {float(-(p * np.log2(p)).sum()):.2f} bits per byte (train), "
              f"zlib -9 {8 * len(zlib.compress(valid, 9)) / len(valid):.2f} bits per byte (valid)")
    return 0


def cmd_train(args) -> int:
    from .data import prepare_builtin
    from .train import Interrupted, load_run_config, train
    from .train.rundir import new_run_dir
    from .train.runs import read_run_config

    if args.resume:
        given = [name for name, value in (("--config", args.config), ("--data", args.data),
                                          ("--data-dir", args.data_dir), ("--set", args.overrides),
                                          ("--out", args.out), ("--fsdp", args.fsdp)) if value]
        if given:
            raise ValueError(f"--resume continues a run as configured; it accepts --max-steps and --max-minutes, "
                             f"not {', '.join(given)}")
        run_dir = Path(args.resume).expanduser()
        run = read_run_config(run_dir)
        for key, value in (("max_steps", args.max_steps), ("max_minutes", args.max_minutes)):
            if value is not None:
                setattr(run.train, key, value)
        run.train.__post_init__()
    else:
        extra = {"data": args.data, "data_dir": args.data_dir, "max_steps": args.max_steps,
                 "max_minutes": args.max_minutes, "fsdp": args.fsdp or None}
        run = load_run_config(args.config, args.overrides, extra)
        run_dir = new_run_dir(run, args.out)
        # One process per machine prepares the built-in data set (each machine may have its own data directory).
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            prepare_builtin(run.train.data, run.train.data_dir)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist  # the other processes wait for that preparation

            from .train.distributed import start
            start(run.train.device)
            dist.barrier()
    try:
        result = train(run, run_dir, resume=bool(args.resume))
    except Interrupted as stop:
        print(f"routeformer: {stop}", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"\nstopped after {result.step} steps ({result.stopped}), {result.minutes:.1f} minutes")
        print(f"validation {result.unit}: {result.valid:.4f} (whole split; final evaluation and sample "
              f"{result.final_seconds:.0f} s)")
        if result.sample is not None:
            prompt, continuation = result.sample
            print(f"sample (the prompt, from the validation split, ends at {PROMPT_END}; the rest is the model's):\n"
                  f"{'-' * 72}\n{prompt}{PROMPT_END}{continuation}\n{'-' * 72}")
        print(f"run directory: {result.run_dir}")
        print(f"checkpoint:    {result.run_dir / 'checkpoint.pt'} (best weights in {result.run_dir / 'best'})")
        print(f"loss curve:    {result.plot}" if result.plot else "loss curve:    not drawn (pip install matplotlib)")
    return 0


def cmd_evaluate(args) -> int:
    from .train import distributed
    from .train.evaluation import UNITS, context_policy, evaluate, metric
    from .train.runs import load_run, pick_device

    run_dir = Path(args.run_dir).expanduser()
    procs = distributed.start(pick_device(args.device))
    try:
        model, run, data, which = load_run(run_dir, args.checkpoint, args.data_dir, str(procs.device))
        seq = run.model.seq_len
        if args.stride is not None and args.stride > seq:
            raise ValueError(f"--stride {args.stride} is larger than seq_len ({seq})")
        if args.stride not in (None, seq) and run.model.positions == "factorized" and run.model.image_shape:
            raise ValueError(f"--stride {args.stride}: this model's positions are an image's rows, columns and "
                             f"channels, so every window must be one whole image (no --stride)")
        tokens = data.split(args.split)
        if len(tokens) < 2:
            raise ValueError(f"the {args.split} split of {data.meta.name!r} is too short to evaluate")
        total, count = evaluate(model, tokens, seq, batch=args.batch_size, procs=procs, stride=args.stride,
                                progress=f"{args.split} split")
        if procs.main:
            mean = total / count
            print(f"{run_dir} ({which} weights) on the {args.split} split of {data.meta.name}: "
                  f"{metric(data.meta.kind, mean):.4f} {UNITS[data.meta.kind]} (mean NLL {mean:.4f} nats over "
                  f"{count:,} predictions; context: {context_policy(seq, args.stride)})")
    finally:
        distributed.stop(procs)
    return 0


def cmd_sample(args) -> int:
    from .train.runs import load_run, pick_device

    run_dir = Path(args.run_dir).expanduser()
    model, run, data, _ = load_run(run_dir, args.checkpoint, args.data_dir, pick_device(args.device))
    kind = data.meta.kind
    if kind == "images":
        raise ValueError("sampling images from the command line is not supported; use TransformerLM.generate")
    if args.prompt_file:
        path = Path(args.prompt_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {path}: no such file")
        text = path.read_bytes()
    else:
        # Python hands undecodable argv bytes over as surrogates: give the model those very bytes back
        text = args.prompt.encode("utf-8", errors="surrogateescape")
    if not text:
        raise ValueError("the prompt is empty")
    prompt = data.encode(text)[None]
    device = next(model.parameters()).device
    sys.stdout.write(text.decode("utf-8", errors="replace"))
    sys.stdout.flush()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    vocab = data.vocab() if kind == "words" else None
    for token in model.stream(torch.from_numpy(prompt).to(device), args.tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed):
        t = int(token[0])
        piece = decoder.decode(bytes([t])) if vocab is None else (
            "\n" if vocab[t] == "<eos>" else " " + vocab[t])
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    return 0


def cmd_analyze(args) -> int:
    from .analysis import run

    if args.analysis == "patterns" and args.text_file:
        path = Path(args.text_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--text-file {path}: no such file")
    target = run.open_target(args.run_dir, split=args.split, checkpoint=args.checkpoint, data_dir=args.data_dir,
                             device=args.device, out=args.out)
    if args.analysis == "approximations":
        rs = (run.parse_ints(args.r, "--r") if args.r is not None
              else sorted({1, 2, 4, 8, 16, target.model.config.head_dim + 1}))
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        files = run.approximations(target, methods=methods, rs=rs, layers=run.parse_layers(args.layers, target.model),
                                   windows=None if args.all_windows else args.windows, batch=args.batch_size,
                                   lsh_rounds=args.lsh_rounds, seed=args.seed)
    elif args.analysis == "heads":
        files = run.heads(target, layers=run.parse_layers(args.layers, target.model), batches=args.batches,
                          batch=args.batch_size)
    elif args.analysis == "patterns":
        text = (Path(args.text_file).expanduser().read_bytes() if args.text_file
                else args.text.encode("utf-8") if args.text is not None else None)
        files = run.patterns(target, layer=args.layer, head=args.head, text=text, length=args.length,
                             batches=args.batches, batch=args.batch_size)
    else:  # routing
        files = run.routing(target, baseline=args.baseline, windows=args.windows, batch=args.batch_size, top=args.top,
                            context=args.context, local_window=args.local_window, checkpoint=args.checkpoint,
                            data_dir=args.data_dir)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def cmd_bench(args) -> int:
    from .bench import attention, model

    if args.suite == "text":
        from .bench import text

        text.run(args.attention, seq_len=args.seq_len, minutes=args.minutes, steps=args.steps, window=args.window,
                 num_clusters=args.num_clusters, routing_window=args.routing_window, data=args.data,
                 data_dir=args.data_dir, out=args.out, overrides=args.overrides)
    elif args.suite == "recall":
        from .bench import recall

        recall.run(args.tasks, args.attention, seq_len=args.seq_len, gap=args.gap, facts=args.facts, depth=args.depth,
                   dim=args.dim,
                   heads=args.heads, window=args.window, num_clusters=args.num_clusters,
                   routing_window=args.routing_window, steps=args.steps,
                   batch=args.batch, lr=args.lr, eval_sequences=args.eval, seeds=args.seeds)
    elif args.suite == "attention":
        attention.run(args.n, batch=args.batch, heads=args.heads, head_dim=args.head_dim, window=args.window,
                      repeats=args.repeats, device=args.device, dtype=DTYPES[args.dtype], causal=not args.non_causal,
                      only=args.only, backend=args.backend)
    elif args.suite == "model":
        model.run(args.n, args.positions, dim=args.dim, depth=args.depth, heads=args.heads, window=args.window,
                  batch=args.batch, repeats=args.repeats, device=args.device, attentions=args.models,
                  backend=args.backend)
    else:
        attention.run([1024, 4096, 16384], device=args.device)
        print()
        model.run([1024, 4096, 8192], [1024, 4096, 16384], device=args.device)
    return 0


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "evaluate": cmd_evaluate, "sample": cmd_sample,
            "analyze": cmd_analyze, "bench": cmd_bench}


if __name__ == "__main__":
    sys.exit(main())
