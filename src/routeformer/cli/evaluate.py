"""`routeformer evaluate`: bits per byte / perplexity / bits per dimension of a run on a split."""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import add_checkpoint, add_data_dir, add_device, add_run_dir, note, positive


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds the ``evaluate`` command to ``commands`` (the top-level sub-parsers)."""
    ev = commands.add_parser(
        "evaluate", help="bits per byte / perplexity / bits per dimension of a run on a split",
        description="Evaluate a run's weights over a whole split in windows of seq_len: bits per byte (byte "
        "data), perplexity (words) or bits per dimension (images). An encoder-decoder run (--config translate): "
        "bits per target byte over the split's pairs, and the split translated and scored with chrF and BLEU "
        "(sacrebleu) beside copying the source. Runs data-parallel under torchrun.")
    add_run_dir(ev)
    ev.add_argument("--split", choices=("valid", "test"), default="valid", help="the split to score (default "
                    "valid)")
    add_checkpoint(ev)
    ev.add_argument("--stride", type=positive, metavar="S", help="advance windows by S < seq_len and score only "
                    "their last S tokens, so every token has at least seq_len - S of context (default: "
                    "non-overlapping windows)")
    ev.add_argument("--batch-size", type=positive, default=8, metavar="B", help="windows (pairs: 8 times as many) "
                    "per forward (default 8)")
    ev.add_argument("--beams", type=positive, default=1, metavar="K", help="an encoder-decoder run's translations: "
                    "beam search with K beams (default 1: greedy)")
    ev.add_argument("--pack", choices=("none", "boundaries"), help="score the split as one text ('none') or each "
                    "document from its own start ('boundaries', the data set's recorded starts) (default: as the "
                    "run trained; a run that packed whole documents scores as 'boundaries')")
    add_data_dir(ev, "where the run's data set lives, if not where it was trained")
    add_device(ev)


def cmd_evaluate(args: argparse.Namespace) -> int:
    import dataclasses

    from ..model.seq2seq import Seq2SeqLM
    from ..train import distributed
    from ..train.config import check_stride
    from ..train.evaluation import UNITS, Scoring, context_policy, evaluate, metric
    from ..train.runs import load_run, pick_device
    from ..train.trainer import document_starts

    run_dir = Path(args.run_dir).expanduser()
    procs = distributed.start(pick_device(args.device))
    try:
        model, run, data, which = load_run(run_dir, args.checkpoint, args.data_dir, str(procs.device))
        if isinstance(model, Seq2SeqLM):
            evaluate_pairs(args, model, data, which, procs)
            return 0
        if args.beams != 1:
            raise ValueError("--beams: beam search translates; this run is a language model (use sample)")
        seq = run.model.seq_len
        check_stride(args.stride, run.model, "--stride")
        tokens = data.split(args.split)
        if len(tokens) < 2:
            raise ValueError(f"the {args.split} split of {data.meta.name!r} is too short to evaluate")
        if procs.main:
            note(model.config.describe_executor(procs.device))
        scoring = run.train if args.pack is None else dataclasses.replace(run.train, pack=args.pack)
        starts = document_starts(data, scoring, args.split)  # as the run trained, unless --pack says otherwise
        total, count = evaluate(model, tokens, Scoring(seq, args.batch_size, stride=args.stride), procs,
                                progress=f"{args.split} split", starts=starts)
        if procs.main:
            mean = total / count
            print(f"{run_dir} ({which} weights) on the {args.split} split of {data.meta.name}: "
                  f"{metric(data.meta.kind, mean):.4f} {UNITS[data.meta.kind]} (mean NLL {mean:.4f} nats over "
                  f"{count:,} predictions; context: {context_policy(seq, args.stride, starts is not None)})")
    finally:
        distributed.stop(procs)
    return 0


def evaluate_pairs(args: argparse.Namespace, model, data, which: str, procs) -> None:
    """``evaluate`` for an encoder-decoder run: bits per target byte over the split's pairs that fit the model,
    then (main process) the whole split translated and scored."""
    from ..train.evaluation import metric
    from ..train.seq2seq_trainer import pair_nll, split_pairs
    from ..train.translation import require_sacrebleu, score, translate_all

    for flag, value in (("--stride", args.stride), ("--pack", args.pack)):
        if value is not None:
            raise ValueError(f"{flag}: an encoder-decoder run scores whole pairs; it takes no {flag}")
    require_sacrebleu()
    fit, every = split_pairs(data, args.split, model.config)
    if procs.main:
        note(model.config.decoder.describe_executor(procs.device))
    total, count = pair_nll(model, fit, 8 * args.batch_size, procs)
    if not procs.main:
        return
    translations = translate_all(model, [s for s, _ in every], batch=8 * args.batch_size, beams=args.beams)
    scores = score(translations, every)
    how = "greedy" if args.beams == 1 else f"beam search, {args.beams} beams"
    print(f"{args.run_dir} ({which} weights) on the {args.split} split of {data.meta.name}: "
          f"{metric('bytes', total / count):.4f} bits per target byte ({count:,} target bytes of the {len(fit):,} "
          f"pairs that fit; {len(every) - len(fit):,} longer left out)\n"
          f"translation ({how}, every pair, sources cut to {model.config.encoder.seq_len} bytes): {scores.line()}")
