"""Issue 73's feasibility run: a small Seq2SeqLM trained on this machine's gettext pairs for a fixed time on the CPU,
then greedy translation of the validation split scored with sacrebleu's chrF and BLEU, beside copying the source.

    python experiments/translate_gettext.py OUT.json [--minutes 10 | --steps S] [--cross routing:2,full:2]
        [--seed 0] [--data-dir DIR] [--tokens 3072] [--copy-steps S --copy-share F] [--dim D] [--layers E,D]
        [--spm V] [--smoothing F] [--gain G]
    # needs `routeformer prepare gettext --lang de --data-dir DIR` and `pip install sacrebleu`

Bytes in, bytes out (or, with --spm, a sentencepiece BPE vocabulary of V pieces trained on the train split; not yet
measured): the decoder reads byte 0 then the target and learns to end with byte 0; sources over 128 bytes and
targets over 159 are left out of training (about 5 % of the pairs) and cut in evaluation. The runs and what they
showed: docs/model.md, "Translating this machine's catalogs". `routeformer train --config translate` is the
command a user runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from routeformer.data import Dataset, read_pairs
from routeformer.model.seq2seq import Seq2SeqConfig, Seq2SeqLM

SOURCE, TARGET = 128, 160
IGNORE = -100


def batch_of(pairs: list[tuple[bytes, bytes]]) -> tuple[torch.Tensor, ...]:
    """source (B, Ns), its padding (B, Ns), target_in (B, Nt), labels (B, Nt)."""
    ns = max(len(s) for s, _ in pairs)
    nt = max(len(t) for _, t in pairs) + 1
    source = torch.zeros(len(pairs), ns, dtype=torch.long)
    padding = torch.zeros(len(pairs), ns, dtype=torch.bool)
    target_in = torch.zeros(len(pairs), nt, dtype=torch.long)
    labels = torch.full((len(pairs), nt), IGNORE, dtype=torch.long)
    for i, (s, t) in enumerate(pairs):
        source[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        padding[i, :len(s)] = True
        tt = torch.tensor(list(t), dtype=torch.long)
        target_in[i, 1:len(t) + 1] = tt
        labels[i, :len(t)] = tt
        labels[i, len(t)] = 0  # the end
    return source, padding, target_in, labels


def bucketed(pairs: list[tuple[bytes, bytes]], tokens: int, gen: torch.Generator) -> list[list[int]]:
    """One epoch of batches of pairs of similar lengths, each at most ``tokens`` padded target bytes, in random
    order: pairs sorted by target length plus noise of 8 bytes, cut greedily, the batches shuffled."""
    noise = torch.rand(len(pairs), generator=gen) * 8
    order = sorted(range(len(pairs)), key=lambda i: max(len(pairs[i][1]) + 1, len(pairs[i][0])) + float(noise[i]))
    batches, current, longest = [], [], 0
    for i in order:
        n = max(len(pairs[i][1]) + 1, len(pairs[i][0]))
        if current and (len(current) + 1) * max(longest, n) > tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    batches.append(current)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=0, help="a budget of steps instead of minutes (timing-free)")
    parser.add_argument("--cross", default="routing:2,full:2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--tokens", type=int, default=0, help="batches of similar lengths up to this many target "
                        "bytes (0: --batch random pairs)")
    parser.add_argument("--copy-steps", type=int, default=0, help="steps over which some pairs are (source, source)")
    parser.add_argument("--copy-share", type=float, default=0.25)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", default="2,2", help="encoder,decoder depth")
    parser.add_argument("--share-positions", action="store_true", help="one absolute position table for both")
    parser.add_argument("--spm", type=int, default=0, help="a sentencepiece BPE vocabulary of this size (0: bytes)")
    parser.add_argument("--smoothing", type=float, default=0.0, help="label smoothing of the training loss")
    parser.add_argument("--gain", type=float, default=0.0, help="Seq2SeqLM's INIT_GAIN instead of its own (0: its own)")
    args = parser.parse_args()
    import sacrebleu

    data = Dataset.open("gettext-de", args.data_dir)
    train = [(s, t) for s, t in read_pairs(data, "train") if len(s) <= SOURCE and len(t) < TARGET]
    valid = [(s[:SOURCE], t) for s, t in read_pairs(data, "valid")]
    vocab, decode = 256, bytes
    references = [t.decode() for _, t in valid]
    sources = [s.decode(errors="replace") for s, _ in valid]
    if args.spm:
        import io

        import sentencepiece as spm
        text = [x.decode(errors="replace") for pair in train for x in pair]
        model_file = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model_file, vocab_size=args.spm,
                                       model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                       add_dummy_prefix=False, remove_extra_whitespaces=False, pad_id=0, unk_id=1,
                                       bos_id=-1, eos_id=-1, character_coverage=1.0, split_digits=True,
                                       num_threads=2, minloglevel=2)
        sp = spm.SentencePieceProcessor(model_proto=model_file.getvalue())
        vocab = sp.get_piece_size()

        def encode(b: bytes) -> list[int]:
            return sp.encode(b.decode(errors="replace"))

        def decode(ids: list[int]) -> bytes:
            return sp.decode(ids).encode()

        byte_total = sum(len(t) + 1 for _, t in train)
        train = [(encode(s), encode(t)) for s, t in train]
        print(f"sentencepiece {vocab}: {sum(len(t) + 1 for _, t in train) / byte_total:.3f} target tokens a byte",
              flush=True)
        valid = [(encode(s)[:SOURCE], t) for s, t in valid]
    enc_depth, dec_depth = (int(x) for x in args.layers.split(","))
    common = dict(vocab_size=vocab, dim=args.dim, heads=4, positions="absolute", token_shift="half")
    config = Seq2SeqConfig(
        encoder=dict(common, depth=enc_depth, seq_len=SOURCE, attention="local:2,routing:2",
                     options={"local": {"window": 16},
                              "routing": {"num_clusters": 8, "window": 16, "probes": 1, "balance": 0.0}}),
        decoder=dict(common, depth=dec_depth, seq_len=TARGET, attention="local:2,full:2",
                     options={"local": {"window": 16}}),
        cross=args.cross, cross_options={"routing": {"num_clusters": 8, "probes": 2}})
    torch.manual_seed(args.seed)
    if args.gain:
        import routeformer.model.seq2seq as seq2seq
        seq2seq.INIT_GAIN = args.gain
    model = Seq2SeqLM(config).train()
    if args.share_positions:  # the decoder's table (the longer) for both stacks
        model.source_positions = model.target_positions
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    started, steps, losses = time.perf_counter(), 0, []
    batches: list[list[int]] = []
    budget = args.minutes * 60
    def done() -> float:  # the share of the budget used: of --steps where given, else of the minutes
        return steps / args.steps if args.steps else (time.perf_counter() - started) / budget

    while done() < 1:
        if args.tokens:
            if not batches:
                batches = bucketed(train, args.tokens, gen)
            chosen = [train[i] for i in batches.pop()]
        else:
            pick = torch.randint(0, len(train), (args.batch,), generator=gen).tolist()
            chosen = [train[i] for i in pick]
        if steps < args.copy_steps:
            flip = torch.rand(len(chosen), generator=gen) < args.copy_share
            chosen = [(s, s) if f else (s, t) for (s, t), f in zip(chosen, flip.tolist(), strict=True)]
        source, padding, target_in, labels = batch_of(chosen)
        logits = model(source, target_in, padding)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                               label_smoothing=args.smoothing)
        for group in opt.param_groups:  # linear decay to 10 % over the budget
            group["lr"] = args.lr * (1 - 0.9 * min(1.0, done()))
        opt.zero_grad(set_to_none=True)
        (loss + model.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.after_optimizer_step()
        steps += 1
        losses.append(float(loss.detach()))
        if steps % 200 == 0:
            print(f"step {steps}: loss {sum(losses[-200:]) / 200:.3f} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    trained = time.perf_counter() - started
    model.eval()
    hypotheses = []
    t0 = time.perf_counter()
    for i in range(0, len(valid), 64):
        chunk = valid[i:i + 64]
        source, padding, _, _ = batch_of([(s, b"") for s, _ in chunk])
        out = model.translate(source, TARGET - 1, source_padding=padding)
        for row in out.tolist():
            end = row.index(0) if 0 in row else len(row)
            hypotheses.append(decode(row[:end]).decode("utf-8", errors="replace"))
    result = {
        "cross": args.cross, "seed": args.seed, "args": vars(args), "steps": steps, "train_seconds": round(trained, 1),
        "translate_seconds": round(time.perf_counter() - t0, 1),
        "last_200_loss": sum(losses[-200:]) / max(1, len(losses[-200:])),
        "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
        "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
        "copy_chrf": sacrebleu.corpus_chrf(sources, [references]).score,
        "copy_bleu": sacrebleu.corpus_bleu(sources, [references]).score,
        "examples": [[sources[i], hypotheses[i], references[i]] for i in range(0, len(valid), len(valid) // 8)],
    }
    Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}))


if __name__ == "__main__":
    main()
