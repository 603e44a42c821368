"""`routeformer train`: train a model from a TOML configuration (with no arguments: the main job)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .options import add_data, add_data_dir, add_out, add_overrides, note, positive, positive_float

PROMPT_END = "⟫"  # printed where a run's final sample turns from its prompt to the model's continuation


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds the ``train`` command to ``commands`` (the top-level sub-parsers)."""
    tr = commands.add_parser(
        "train", help="train a model (with no arguments: the main job on stdlib)",
        description="Train a model from a TOML configuration ([model] and [train] tables; default: the shipped "
        "default.toml, a half-local half-routing byte model trained on stdlib in about ten minutes on 2 CPU "
        "cores). Under torchrun, one process per GPU (or CPU worker) trains data-parallel. Ctrl-C saves a "
        "checkpoint and exits; --resume continues it exactly.")
    tr.add_argument("--config", metavar="FILE", help="a TOML file, or a shipped name: default, enwik8, "
                    "wikitext103, imagenet64, translate (an encoder-decoder model on this machine's gettext "
                    "catalogs)")
    add_data(tr, "data set to train on (overrides [train] data)")
    add_data_dir(tr)
    add_overrides(tr)
    add_out(tr, "run directory (default runs/<data>-<date>-<time>)")
    tr.add_argument("--max-steps", type=positive, metavar="S",
                    help="train to optimiser step S (counted from the run's start; the cosine decay ends there, or "
                    "when the time budget runs out first, unless decay_steps is set)")
    tr.add_argument("--max-minutes", type=positive_float, metavar="M",
                    help="stop after M minutes of this invocation (then evaluate and save)")
    tr.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint (only "
                    "--max-steps and --max-minutes may change)")
    tr.add_argument("--fsdp", action="store_true", help="shard parameters with FSDP2 instead of DDP (torchrun)")


def cmd_train(args: argparse.Namespace) -> int:
    from ..data import prepare_builtin
    from ..train import Diverged, Interrupted, load_run_config, train
    from ..train.result import Seq2SeqResult
    from ..train.rundir import new_run_dir
    from ..train.runs import read_run_config

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

            from ..train.distributed import start
            start(run.train.device)
            dist.barrier()
    try:
        result = train(run, run_dir, resume=bool(args.resume), say=note)
    except Interrupted as stop:
        print(f"routeformer: {stop}", file=sys.stderr)
        return 130
    except Diverged as err:
        print(f"\nrouteformer: {err}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"\nstopped after {result.step} steps ({result.stopped}), {result.minutes:.1f} minutes")
        print(f"validation {result.unit}: {result.valid:.4f} (whole split in {result.context}; final evaluation "
              f"and sample {result.final_seconds:.0f} s)")
        if isinstance(result, Seq2SeqResult) and result.scores is not None:
            print(f"validation translation: {result.scores.line()}")
            source, translation = result.sample
            print(f"a translation (greedy) of a validation source:\n{'-' * 72}\n{source}\n{PROMPT_END} "
                  f"{translation}\n{'-' * 72}")
        elif result.sample is not None:
            prompt, continuation = result.sample
            print(f"sample (the prompt, from the validation split, ends at {PROMPT_END}; the rest is the model's):\n"
                  f"{'-' * 72}\n{prompt}{PROMPT_END}{continuation}\n{'-' * 72}")
        print(f"run directory: {result.run_dir}")
        print(f"checkpoint:    {result.run_dir / 'checkpoint.pt'} (best weights in {result.run_dir / 'best'})")
        print(f"loss curve:    {result.plot}" if result.plot else "loss curve:    not drawn (pip install matplotlib)")
    return 0
