"""`routeformer bench`: the attention, model, recall and text benchmarks, which print tables."""

from __future__ import annotations

import argparse

import torch

from .options import (
    add_attention_specs,
    add_backend,
    add_data,
    add_data_dir,
    add_device,
    add_lengths,
    add_out,
    add_overrides,
    add_routing_sizes,
    add_seq_len,
    add_size,
    add_window,
    count,
    note,
    positive,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds the ``bench`` command to ``commands`` (the top-level sub-parsers)."""
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
    add_lengths(att, [1024, 4096, 16384], "sequence lengths")
    add_size(att, "--batch", 1, "batch size B")
    add_size(att, "--heads", 8, "heads H")
    add_size(att, "--head-dim", 64, "head size D")
    add_window(att, 256, "local / Longformer window")
    add_size(att, "--repeats", 3, "timed rounds, median reported")
    add_device(att, bench=True)
    att.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="tensor dtype (default float32)")
    att.add_argument("--non-causal", action="store_true", help="encoder (non-causal) variants")
    add_backend(att)
    att.add_argument("--only", nargs="+", metavar="NAME",
                     help="mechanisms to run beside full, with their peers (e.g. local strided lsh performer)")
    att.add_argument("--json", metavar="FILE", help="also write the measured rows to FILE as JSON (the settings "
                     "and, per row, n, mechanism, fwd_s, fwd_bwd_s, inference/training/kept bytes, note)")
    att.add_argument("--leak-n", type=count, default=None, metavar="N",
                     help="the causal leak table's length (default min(1024, the longest N); 0: no leak table)")
    att.add_argument("--documents", type=count, default=0, metavar="K",
                     help="also measure each of our rows over rows packed with K equal documents, the two timed "
                     "call by call in turn, and print the ratio (default 0: not)")

    mod = suites.add_parser(
        "model",
        help="training throughput, memory and generation speed of full, local and local+routing models",
        description="Tokens per second and peak memory of a whole training step (forward, backward, AdamW step, "
        "k-means update) of three models of one size that differ only in attention (full, local, half local and "
        "half routing), and milliseconds per generated token after prompts of the given lengths.",
    )
    add_lengths(mod, [1024, 4096, 8192], "training lengths")
    mod.add_argument("--positions", type=positive, nargs="+", default=[1024, 4096, 16384],
                     help="prompt lengths at which generation is timed")
    add_size(mod, "--dim", 256, "model width")
    add_size(mod, "--depth", 4, "layers")
    add_size(mod, "--heads", 8, "heads per layer")
    add_window(mod, 256)
    from ..bench import model as bench_model  # the row names (this imports nothing beyond the package)

    mod.add_argument("--models", nargs="+", metavar="NAME", default=list(bench_model.MODELS),
                     help="rows: attention specs ('full', 'local:4,routing:4') or presets "
                     f"({', '.join(bench_model.PRESETS)}); the first is the baseline (default: %(default)s)")
    add_size(mod, "--batch", 1, "sequences per training step")
    add_size(mod, "--repeats", 3, "timed training steps, median reported")
    add_device(mod, bench=True)
    add_backend(mod)

    rec = suites.add_parser(
        "recall",
        help="long-range recall: accuracy of full, local and local+routing models trained on synthetic tasks",
        description="Trains one small model per (task, attention) for a fixed number of steps on recall tasks "
        "generated on the fly (multi-query associative recall, passkey, two-hop recall, recall with overwrites, "
        "one-hop key-value recall), each with a gap longer than depth × window so that local-only attention stays "
        "at chance, and prints accuracy, its ratio to a reference (full attention trained with a curriculum, "
        "the first row of each task), chance, seconds per step, keys scored per query and what the routing heads "
        "reached (cluster balance, needed key in the query's cluster, in its window).",
    )
    rec.add_argument("--tasks", nargs="+", default=["mqar", "passkey", "two_hop"], metavar="TASK",
                     help="mqar, passkey, two_hop, latest, one_hop (default: the first three)")
    add_attention_specs(rec, ["full", "local", "local+routing"],
                        "full, local, local+routing (half and half) or any attention spec (local:2,routing:2); "
                        "a suffix /shared, /joint or /separate says how routing heads route, and '@field=value' "
                        "suffixes set model config fields for the row (local+routing@options.routing.probes=1) "
                        "(default: full local local+routing)")
    rec.add_argument("--reference", default="full", metavar="SPEC",
                     help="what every row is judged against ('vs ref'): an attention row as in --attention, trained "
                     "on the same seeds with a curriculum and printed first with each seed's accuracy; 'none': "
                     "no reference, the ratio is over the first row ('vs first') (default: full)")
    rec.add_argument("--reference-steps", type=positive, metavar="S",
                     help="the reference's training steps (default: --steps)")
    rec.add_argument("--reference-curriculum", type=_curriculum, metavar="C:L",
                     help="the reference's first C steps on sequences of length L (the batch cut into them, the task "
                     "re-generated with its gap just past local reach), then the full length; C alone: the "
                     "default L; 0: none (default: C = min(800, reference steps / 2), L = N / 4, doubled until the "
                     "task fits)")
    rec.add_argument("--reference-seeds", type=int, nargs="+", metavar="SEED",
                     help="the reference's seeds (default: --seeds)")
    add_seq_len(rec, 128, "sequence length N")
    rec.add_argument("--gap", type=positive, default=32, help="positions between an answer and what it needs "
                     "are more than this (default 32; at least depth × (window - 1))")
    add_size(rec, "--facts", 4, "mqar and one_hop: facts per sequence, each with its own key")
    add_size(rec, "--depth", 2, "layers")
    add_size(rec, "--dim", 64, "model width")
    add_size(rec, "--heads", 4, "heads per layer")
    add_window(rec, 8)
    add_routing_sizes(rec, "N")
    add_size(rec, "--steps", 800, "training steps per model")
    add_size(rec, "--batch", 32, "sequences per step")
    rec.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    rec.add_argument("--eval", type=positive, default=512, help="held-out sequences scored (default 512)")
    rec.add_argument("--seeds", type=int, nargs="+", default=[0], metavar="SEED",
                     help="model initialisation seeds: every row trains once per seed and reports the mean "
                     "(default 0)")
    add_device(rec, bench=True)
    rec.add_argument("--json", metavar="FILE", help="also write the rows to FILE as JSON (the settings and, per row, "
                     "task, attention, accuracy, each seed's, its ratio to the reference)")

    txt = suites.add_parser(
        "text",
        help="validation bits per byte of local, local+routing and full models at one budget",
        description="Trains one model per attention with the shipped default configuration (data set, width, "
        "schedule) at the given context and wall-clock budget, and prints each one's bits per byte on the whole "
        "validation split.",
    )
    add_attention_specs(txt, ["local", "local+routing", "full"],
                         "as for bench recall (default: local local+routing full)")
    add_seq_len(txt, 1024, "context")
    txt.add_argument("--minutes", type=float, default=4.0, help="training budget per model (default 4)")
    add_size(txt, "--steps", 2000, "steps of the cosine schedule")
    add_window(txt, None, "local window (default: the configuration's, 128)")
    add_routing_sizes(txt, "seq_len")
    add_data(txt, "data set (default stdlib)", default="stdlib")
    add_data_dir(txt)
    txt.add_argument("--device", help="where the rows train and are scored: auto, cpu, cuda or cuda:N (default: "
                     "the configuration's device, auto: a GPU if there is one)")
    from ..train.config import PRECISIONS

    txt.add_argument("--dtype", choices=PRECISIONS, help="the rows' precision (autocast in training and scoring; "
                     "default: the configuration's, auto: bfloat16 on a GPU that has it, else float16 there, "
                     "float32 on the CPU)")
    add_out(txt, "where the run directories go", default="runs/bench-text", metavar="DIR")
    add_overrides(txt, "override a [model] or [train] field for every row (--set decay_steps=0: the cosine over "
                  "the time budget instead of --steps)")

    every = suites.add_parser("all", help="the attention benchmark, then the model benchmark (defaults)",
                              description="Run 'bench attention' and then 'bench model', each with its defaults.")
    add_device(every, bench=True)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench import attention, model
    from ..bench.measure import Echo

    echo = Echo(print, note)  # tables on stdout, the executor's line on stderr
    if args.suite == "text":
        from ..bench import text

        text.run(args.attention, text.TextBench(
            seq_len=args.seq_len, minutes=args.minutes, steps=args.steps, window=args.window,
            num_clusters=args.num_clusters, routing_window=args.routing_window, data=args.data, data_dir=args.data_dir,
            out=args.out, overrides=tuple(text_overrides(args))), echo)
    elif args.suite == "recall":
        from ..bench import recall

        training = recall.Training(steps=args.steps, batch=args.batch, lr=args.lr, eval_sequences=args.eval,
                                   seeds=args.seeds, device=args.device)
        rows = recall.run(args.tasks, args.attention, recall_settings(args), training,
                          reference=recall_reference(args), echo=echo)
        if args.json:
            _write_json(args.json, {"suite": "recall", "settings": {key: getattr(args, key) for key in (
                "tasks", "attention", "reference", "reference_steps", "seq_len", "gap", "facts", "depth", "dim",
                "heads", "window", "steps", "batch", "lr", "eval", "seeds", "device")}, "rows": rows})
    elif args.suite == "attention":
        rows = attention.run(args.n, attention_bench(args), echo)
        if args.json:
            _write_json(args.json, {"suite": "attention", "settings": {
                key: getattr(args, key) for key in ("batch", "heads", "head_dim", "window", "repeats", "device",
                                                    "dtype", "non_causal", "backend", "documents")},
                "rows": rows})
    elif args.suite == "model":
        model.run(args.n, args.positions, model_bench(args), echo)
    else:
        attention.run([1024, 4096, 16384], attention.AttentionBench(device=args.device), echo)
        print()
        model.run([1024, 4096, 8192], [1024, 4096, 16384], model.ModelBench(device=args.device), echo)
    return 0


def attention_bench(args: argparse.Namespace):
    """bench attention's settings (``bench.attention.AttentionBench``)."""
    from ..bench.attention import AttentionBench

    return AttentionBench(batch=args.batch, heads=args.heads, head_dim=args.head_dim, window=args.window,
                          repeats=args.repeats, device=args.device, dtype=DTYPES[args.dtype],
                          causal=not args.non_causal, only=None if args.only is None else tuple(args.only),
                          backend=args.backend, leak_n=args.leak_n, documents=args.documents)


def model_bench(args: argparse.Namespace):
    """bench model's settings (``bench.model.ModelBench``)."""
    from ..bench.model import ModelBench

    return ModelBench(dim=args.dim, depth=args.depth, heads=args.heads, window=args.window, batch=args.batch,
                      repeats=args.repeats, device=args.device, attentions=tuple(args.models),
                      backend=args.backend)


def recall_settings(args: argparse.Namespace):
    """bench recall's task and model sizes (``bench.recall.RecallSettings``)."""
    from ..bench.recall import RecallSettings

    return RecallSettings(seq_len=args.seq_len, gap=args.gap, facts=args.facts, depth=args.depth, dim=args.dim,
                          heads=args.heads, window=args.window, num_clusters=args.num_clusters,
                          routing_window=args.routing_window)


def recall_reference(args: argparse.Namespace):
    """bench recall's ``Reference`` from --reference*, or None for '--reference none' (which takes no other
    --reference-* option: they would be ignored)."""
    from ..bench.recall import Curriculum, Reference

    if args.reference.strip().lower() == "none":
        given = [flag for flag, value in (("--reference-steps", args.reference_steps),
                                          ("--reference-curriculum", args.reference_curriculum),
                                          ("--reference-seeds", args.reference_seeds)) if value is not None]
        if given:
            raise ValueError(f"--reference none trains no reference: {', '.join(given)} would be ignored")
        return None
    return Reference(args.reference, steps=args.reference_steps,
                     curriculum=args.reference_curriculum or Curriculum(), seeds=args.reference_seeds)


def _curriculum(text: str):
    """An argparse type: --reference-curriculum's C:L (``bench.recall.Curriculum.parse``)."""
    from ..bench.recall import Curriculum

    try:
        return Curriculum.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def text_overrides(args: argparse.Namespace) -> list[str]:
    """bench text's --set items with --device and --dtype as the [train] fields they set (device, precision); a
    ValueError when one is given both ways."""
    overrides = list(args.overrides)
    for flag, key, value in (("--device", "device", args.device), ("--dtype", "precision", args.dtype)):
        if value is None:
            continue
        if any(item.partition("=")[0].strip().removeprefix("train.") == key for item in overrides):
            raise ValueError(f"{flag} {value} and --set {key}=... both set the rows' {key}: give one of them")
        overrides.append(f"{key}={value}")
    return overrides


def _write_json(path: str, table: dict) -> None:
    """``table`` as JSON at ``path`` (its folder made), whole or not at all (``durable.atomic_write``)."""
    import json
    from pathlib import Path

    from ..durable import atomic_write

    atomic_write(Path(path).expanduser(), lambda tmp: Path(tmp).write_text(json.dumps(table, indent=1) + "\n"))
