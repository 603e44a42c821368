"""A task only content-based cross-attention can solve (issue 73): the source holds key-value pairs, the target asks
for the keys in another order and must answer each with its value.

Source: ``pairs`` distinct keys with random values, interleaved, k_1 v_1 k_2 v_2 … (bytes: keys from KEYS, values
from VALUES). Target: the same keys in a random order, each followed by its value; the decoder reads 0 q_1 a_1 q_2
a_2 … and is scored on the answers a_i only (the position after each q_i). Where a key sits in the source is random,
so no fixed pattern of positions finds its value: a cross head must match the asked key's content. Chance is
1 / len(VALUES).

``run_lookup`` trains a ``Seq2SeqLM`` on fresh batches and reports the answers' accuracy on held-out batches: the
benchmark's (``experiments/cross_lookup.py``) and the tests' (a tiny model learns it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.seq2seq import Seq2SeqConfig, Seq2SeqLM

KEYS = range(16, 112)  # 96 key bytes
VALUES = range(128, 160)  # 32 value bytes: chance 1/32
IGNORE = -100


@dataclass(frozen=True)
class LookupBatch:
    """source (B, 2P); target_in (B, 2P) the decoder's inputs 0 q_1 a_1 …; labels (B, 2P): a_i after each q_i,
    IGNORE elsewhere."""

    source: Tensor
    target_in: Tensor
    labels: Tensor


def lookup_batch(batch: int, pairs: int, generator: torch.Generator) -> LookupBatch:
    """One batch of the task (see the module). O(batch · pairs)."""
    if not 0 < pairs <= len(KEYS):
        raise ValueError(f"pairs must be in [1, {len(KEYS)}], got {pairs}")
    keys = torch.rand(batch, len(KEYS), generator=generator).argsort(-1)[:, :pairs] + KEYS.start  # distinct keys
    values = torch.randint(VALUES.start, VALUES.stop, (batch, pairs), generator=generator)
    source = torch.stack([keys, values], -1).reshape(batch, 2 * pairs)
    order = torch.rand(batch, pairs, generator=generator).argsort(-1)  # the keys asked, in another order
    asked, answers = keys.gather(1, order), values.gather(1, order)
    target = torch.stack([asked, answers], -1).reshape(batch, 2 * pairs)  # q_1 a_1 q_2 a_2 …
    target_in = torch.cat([torch.zeros(batch, 1, dtype=torch.long), target[:, :-1]], 1)
    labels = torch.full_like(target, IGNORE)
    labels[:, 1::2] = answers  # scored: the answer after each asked key
    return LookupBatch(source, target_in, labels)


@dataclass(frozen=True)
class LookupRun:
    """What ``run_lookup`` measured: the answers' accuracy on held-out batches, the last training loss, the steps
    and the seconds they took."""

    accuracy: float
    loss: float
    steps: int
    seconds: float


def run_lookup(config: Seq2SeqConfig, *, pairs: int, steps: int, batch: int = 16, lr: float = 3e-3, seed: int = 0,
               eval_batches: int = 4) -> LookupRun:
    """Train a fresh ``Seq2SeqLM(config)`` for ``steps`` AdamW steps on fresh batches (seeded), the routing heads'
    k-means steps after each; then its greedy answers' accuracy on ``eval_batches`` held-out batches."""
    torch.manual_seed(seed)
    model = Seq2SeqLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    started, loss = time.perf_counter(), torch.zeros(())
    for _ in range(steps):
        b = lookup_batch(batch, pairs, gen)
        logits = model(b.source, b.target_in)
        loss = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        (loss + model.aux_loss).backward()
        optimizer.step()
        model.after_optimizer_step()
    seconds = time.perf_counter() - started
    model.eval()
    held_out = torch.Generator().manual_seed(10_000 + seed)
    right = total = 0
    with torch.no_grad():
        for _ in range(eval_batches):
            b = lookup_batch(batch, pairs, held_out)
            guess = model(b.source, b.target_in).argmax(-1)
            scored = b.labels != IGNORE
            right += int((guess[scored] == b.labels[scored]).sum())
            total += int(scored.sum())
    return LookupRun(right / total, float(loss.detach()), steps, seconds)


__all__ = ["IGNORE", "KEYS", "VALUES", "LookupBatch", "LookupRun", "lookup_batch", "run_lookup"]
