"""The sample a finished run prints: its model continuing the start of the validation split, decoded as text."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from ..data import Dataset
from ..model import TransformerLM


def sample(model: TransformerLM, data: Dataset, *, tokens: int, seed: int, device: torch.device,
           autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
           ) -> tuple[str, str] | None:
    """(prompt, continuation) as text: ``tokens`` tokens (temperature 0.8, top-p 0.95, ``seed``) after a prompt of
    64 tokens of the validation split, from its first line start for bytes; None for images or ``tokens`` = 0."""
    kind = data.meta.kind
    if kind == "images" or tokens == 0:
        return None
    valid = np.asarray(data.split("valid")[:4096])
    start = 0
    if kind == "bytes":  # begin at a line start, as a reader would
        newline = np.flatnonzero(valid[:-64] == 10)
        start = int(newline[0]) + 1 if len(newline) else 0
    prompt = torch.from_numpy(valid[start:start + 64].astype(np.int64))[None].to(device)
    with autocast():
        out = model.generate(prompt, tokens, temperature=0.8, top_p=0.95, seed=seed)
    ids, vocab = out[0].tolist(), data.vocab()
    return decode(ids[:prompt.shape[1]], kind, vocab), decode(ids[prompt.shape[1]:], kind, vocab)


def decode(ids: list[int], kind: str, vocab: list[str] | None) -> str:
    """Tokens as text: bytes as UTF-8 (invalid sequences replaced), words joined by spaces (<eos> = newline)."""
    if kind == "words" and vocab is not None:
        return " ".join(vocab[i] for i in ids).replace(" <eos> ", "\n").replace("<eos>", "\n")
    return bytes(ids).decode("utf-8", errors="replace")
