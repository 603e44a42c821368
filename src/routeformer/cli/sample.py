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
        "is generated. An encoder-decoder run (--config translate) translates the prompt instead (greedy by default, "
        "or --beams K).")
    add_run_dir(sa)
    src = sa.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the text to continue (or to translate)")
    src.add_argument("--prompt-file", metavar="FILE", help="read the text to continue from FILE")
    sa.add_argument("--tokens", type=positive, metavar="N", help="tokens to generate (default 300; a translation: "
                    "up to the decoder's seq_len - 1)")
    sa.add_argument("--temperature", type=float, metavar="T", help="0 for greedy (default 0.8; a translation: 0)")
    sa.add_argument("--beams", type=positive, default=1, metavar="K", help="a translation by beam search with K beams "
                    "(default 1)")
    sa.add_argument("--top-k", type=positive, metavar="K", help="sample among the K most likely tokens")
    sa.add_argument("--top-p", type=positive_float, metavar="P",
                    help="sample among the most likely tokens whose probabilities sum to P (nucleus, 0 < P <= 1)")
    sa.add_argument("--seed", type=int, metavar="S", help="make the sample repeatable")
    add_checkpoint(sa)
    add_data_dir(sa, "where the run's data set lives (for its vocabulary), if not where it was trained")
    add_device(sa)


def cmd_sample(args: argparse.Namespace) -> int:
    from ..model.seq2seq import Seq2SeqLM
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
    if isinstance(model, Seq2SeqLM):
        print(translate_prompt(model, text, args))
        return 0
    if args.beams != 1:
        raise ValueError("--beams: beam search translates; this run is a language model")
    prompt = data.encode(text)[None]
    device = next(model.parameters()).device
    note(model.config.describe_executor(device))
    sys.stdout.write(text.decode("utf-8", errors="replace"))
    sys.stdout.flush()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    vocab = data.vocab() if kind == "words" else None
    temperature = 0.8 if args.temperature is None else args.temperature
    for token in model.stream(torch.from_numpy(prompt).to(device), args.tokens or 300, temperature=temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed):
        t = int(token[0])
        piece = decoder.decode(bytes([t])) if vocab is None else (
            "\n" if vocab[t] == "<eos>" else " " + vocab[t])
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    return 0


def translate_prompt(model, text: bytes, args: argparse.Namespace) -> str:
    """An encoder-decoder run's translation of ``text`` (at most the encoder's seq_len bytes)."""
    from ..data.pairs import START, pair_batch
    from ..model.seq2seq import Sampling

    longest_in, longest_out = model.config.encoder.seq_len, model.config.decoder.seq_len - 1
    if len(text) > longest_in:
        raise ValueError(f"the prompt holds {len(text)} bytes; this model reads sources of at most {longest_in}")
    tokens = longest_out if args.tokens is None else args.tokens
    if tokens > longest_out:
        raise ValueError(f"--tokens {tokens}: this model's targets hold at most {longest_out} bytes")
    device = next(model.parameters()).device
    note(model.config.decoder.describe_executor(device))
    batch = pair_batch([(text, b"")])
    sampling = None if not args.temperature else Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    out = model.translate(batch.source.to(device), tokens, source_padding=batch.source_padding.to(device),
                          start=START, stop=START, sampling=sampling, beams=args.beams)[0].tolist()
    return bytes(out[:out.index(START)] if START in out else out).decode("utf-8", errors="replace")
