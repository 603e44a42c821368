"""Issue 73's feasibility run: a small Seq2SeqLM trained on this machine's gettext pairs for a fixed time on the CPU,
then greedy translation of the validation split scored with sacrebleu's chrF and BLEU, beside copying the source.

    python experiments/translate_gettext.py OUT.json [--minutes 10] [--cross routing:2,full:2] [--seed 0]
        [--data-dir DIR]   # needs `routeformer prepare gettext --lang de --data-dir DIR` and `pip install sacrebleu`

Bytes in, bytes out: the decoder reads byte 0 then the target and learns to end with byte 0; sources over 128
bytes and targets over 159 are left out of training (about 5 % of the pairs) and cut in evaluation.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--cross", default="routing:2,full:2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()
    import sacrebleu

    data = Dataset.open("gettext-de", args.data_dir)
    train = [(s, t) for s, t in read_pairs(data, "train") if len(s) <= SOURCE and len(t) < TARGET]
    valid = [(s[:SOURCE], t) for s, t in read_pairs(data, "valid")]
    common = dict(vocab_size=256, dim=128, heads=4, positions="absolute", token_shift="half")
    config = Seq2SeqConfig(
        encoder=dict(common, depth=2, seq_len=SOURCE, attention="local:2,routing:2",
                     options={"local": {"window": 16},
                              "routing": {"num_clusters": 8, "window": 16, "probes": 1, "balance": 0.0}}),
        decoder=dict(common, depth=2, seq_len=TARGET, attention="local:2,full:2", options={"local": {"window": 16}}),
        cross=args.cross, cross_options={"routing": {"num_clusters": 8, "probes": 2}})
    torch.manual_seed(args.seed)
    model = Seq2SeqLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    started, steps, losses = time.perf_counter(), 0, []
    budget = args.minutes * 60
    while time.perf_counter() - started < budget:
        pick = torch.randint(0, len(train), (args.batch,), generator=gen).tolist()
        source, padding, target_in, labels = batch_of([train[i] for i in pick])
        logits = model(source, target_in, padding)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        for group in opt.param_groups:  # linear decay to 10 % over the budget
            group["lr"] = args.lr * (1 - 0.9 * min(1.0, (time.perf_counter() - started) / budget))
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
            hypotheses.append(bytes(row[:end]).decode("utf-8", errors="replace"))
    references = [t.decode() for _, t in valid]
    sources = [s.decode(errors="replace") for s, _ in valid]
    result = {
        "cross": args.cross, "seed": args.seed, "steps": steps, "train_seconds": round(trained, 1),
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
