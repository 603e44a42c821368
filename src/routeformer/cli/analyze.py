"""`routeformer analyze`: what approximations lose, how heads differ, what routing attends to."""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import add_checkpoint, add_data_dir, add_device, add_run_dir, positive


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds the ``analyze`` command to ``commands`` (the top-level sub-parsers)."""
    an = commands.add_parser(
        "analyze", help="what approximations lose, how heads differ, what routing attends to",
        description="Analyse a trained run on a split of its data: 'approximations' replaces every head's output "
        "by sparse or approximate attention (the value-aware study); 'heads' measures the Jensen-Shannon "
        "divergence between heads (the routing paper's Table 4); 'patterns' draws which inputs each output "
        "attends to (its Figure 1) and the routing heads' cluster statistics; 'routing' shows what the routing "
        "heads use and where they beat a local model; 'copying' whether the model predicts text read a second "
        "time. Writes text and CSV files and (all but 'copying') PNG figures to RUN_DIR/analysis (or --out) and "
        "prints their paths.")
    add_run_dir(an)
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
    approx.add_argument("--windows", type=positive, default=32, metavar="W",
                        help="evenly spaced windows of seq_len tokens to score (default 32)")
    approx.add_argument("--all-windows", action="store_true", help="score the whole split")
    approx.add_argument("--lsh-rounds", type=positive, default=1, help="LSH hash rounds (default 1)")
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
    pat.add_argument("--length", type=positive, metavar="N", help="draw the first N tokens (default seq_len)")
    rt = kinds.add_parser("routing", help="what the routing heads use: mass beyond the local window, distances, "
                          "the most-attended far pairs, and where routing's loss beats a baseline's",
                          description="The routing heads' attention on --windows windows of the split: the share of "
                          "their mass beyond the model's local window, the mass by distance, the --top most-attended "
                          "pairs beyond the local window printed as text with whether the --context tokens ending "
                          "at query and key match; with --baseline RUN (a local model on the same data and length), "
                          "the per-token loss of both by the distance to the previous occurrence of the last "
                          "--context tokens (a table, a CSV and a figure).")
    cp = kinds.add_parser("copying", help="the loss on text read a second time against the first reading: does "
                          "the model copy what it has read?",
                          description="Each of --windows windows of the split cut to its first L tokens and repeated "
                          "to seq_len: the mean loss (bits per token) on the first reading and on the repeat, for "
                          "each L of --lengths. A model that has learned to copy (an induction circuit) predicts the "
                          "repeat far better; one that has not does no better.")
    cp.add_argument("--lengths", metavar="L1,L2,...", help="repeat lengths, each in [2, seq_len) (default seq_len/4 "
                    "and seq_len/2)")
    cp.add_argument("--windows", type=positive, default=32, help="windows of the split (default 32)")
    rt.add_argument("--baseline", metavar="RUN_DIR", help="a run to compare per-token losses with (a local model)")
    rt.add_argument("--windows", type=positive, default=16, help="windows of seq_len tokens to analyse (default 16)")
    rt.add_argument("--top", type=positive, default=100, help="the most-attended far pairs to print (default 100)")
    rt.add_argument("--context", type=positive, default=8, help="tokens that make a context (default 8)")
    rt.set_defaults(reads_encoder_decoder=True)  # the one analysis that reads an encoder-decoder run
    rt.add_argument("--pairs", type=positive, default=256, help="an encoder-decoder run: pairs of the split, each "
                    "read alone: what its encoder's and cross heads' routing reads, and its recall of their dense "
                    "attention (default 256)")
    rt.add_argument("--local-window", type=positive, metavar="W",
                    help="the distance from which a key counts as far (default the model's local window)")
    for sub in (approx, hd, pat, rt, cp):
        sub.add_argument("--split", choices=("valid", "test"), default="valid", help="the split (default valid)")
        sub.add_argument("--batch-size", type=positive, default=4 if sub is not approx else 8, metavar="B",
                         help="windows per forward")
        add_checkpoint(sub)
        add_data_dir(sub, "where the run's data set lives, if not where it was trained")
        add_device(sub)
        sub.add_argument("--out", metavar="DIR", help="where to write (default RUN_DIR/analysis)")
    for sub in (approx, hd):
        sub.add_argument("--layers", metavar="L1,L2,...", help="only these layers (default all)")
    for sub in (hd, pat):
        sub.add_argument("--batches", type=positive, default=4, help="batches of windows for the statistics "
                         "(default 4)")


def cmd_analyze(args: argparse.Namespace) -> int:
    from ..analysis import run

    if args.analysis == "patterns" and args.text_file:
        path = Path(args.text_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--text-file {path}: no such file")
    if getattr(args, "reads_encoder_decoder", False) and run.is_encoder_decoder_run(args.run_dir):
        if args.baseline is not None:
            raise ValueError("--baseline compares language-model runs; an encoder-decoder run is read alone")
        files = run.seq2seq_routing(args.run_dir, split=args.split, checkpoint=args.checkpoint,
                                    data_dir=args.data_dir, device=args.device, out=args.out, pairs=args.pairs,
                                    local_window=args.local_window)
        print("wrote " + ", ".join(str(f) for f in files))
        return 0
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
    elif args.analysis == "copying":
        lengths = None if args.lengths is None else run.parse_ints(args.lengths, "--lengths")
        files = run.copying(target, lengths=lengths, windows=args.windows, batch=args.batch_size)
    else:  # routing
        baseline = None if args.baseline is None else run.Baseline(args.baseline, args.checkpoint, args.data_dir)
        files = run.routing(target, baseline, windows=args.windows, batch=args.batch_size, top=args.top,
                            context=args.context, local_window=args.local_window)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
