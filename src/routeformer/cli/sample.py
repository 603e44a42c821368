"""`routeformer sample`: continue a prompt with a run's model, streamed as it is generated."""

from __future__ import annotations

import argparse
import codecs
import sys
from pathlib import Path

import torch

from .options import add_checkpoint, add_data_dir, add_device, add_run_dir, note, positive, positive_float


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds the ``sample`` command to ``commands`` (the top-level sub-parsers)."""
    sa = commands.add_parser(
        "sample", help="generate text from a run, streamed as it is produced",
        description="Continue a prompt with a run's model through its cached generation, printing the text as it "
        "is generated.")
    add_run_dir(sa)
    src = sa.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the text to continue")
    src.add_argument("--prompt-file", metavar="FILE", help="read the text to continue from FILE")
    sa.add_argument("--tokens", type=positive, default=300, metavar="N", help="tokens to generate")
    sa.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 for greedy")
    sa.add_argument("--top-k", type=positive, metavar="K", help="sample among the K most likely tokens")
    sa.add_argument("--top-p", type=positive_float, metavar="P",
                    help="sample among the most likely tokens whose probabilities sum to P (nucleus, 0 < P <= 1)")
    sa.add_argument("--seed", type=int, metavar="S", help="make the sample repeatable")
    add_checkpoint(sa)
    add_data_dir(sa, "where the run's data set lives (for its vocabulary), if not where it was trained")
    add_device(sa)


def cmd_sample(args: argparse.Namespace) -> int:
    from ..train.runs import load_run, pick_device

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
    note(model.config.describe_executor(device))
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
