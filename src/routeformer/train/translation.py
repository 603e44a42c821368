"""Translating a split of pairs with an encoder-decoder model, and scoring it with sacrebleu (chrF, BLEU) beside
the source copied unchanged (the floor every translation must beat: many messages are names and formats)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..data.pairs import START, pair_batch
from ..model.seq2seq import Seq2SeqLM


def require_sacrebleu() -> None:
    """A one-line error naming the extra where sacrebleu (chrF and BLEU) is not installed."""
    try:
        import sacrebleu  # noqa: F401
    except ImportError:
        raise ValueError("translation scores (chrF, BLEU) need sacrebleu: pip install 'routeformer[translate]'") \
            from None


@dataclass(frozen=True)
class TranslationScores:
    """Corpus chrF and BLEU (sacrebleu's defaults) of the model's translations and of the sources copied unchanged,
    over ``pairs`` pairs."""

    chrf: float
    bleu: float
    copy_chrf: float
    copy_bleu: float
    pairs: int

    def line(self) -> str:
        return (f"chrF {self.chrf:.1f}, BLEU {self.bleu:.1f} (copying the source: chrF {self.copy_chrf:.1f}, BLEU "
                f"{self.copy_bleu:.1f}; {self.pairs:,} pairs, sacrebleu)")


def score(hypotheses: Sequence[bytes], pairs: Sequence[tuple[bytes, bytes]]) -> TranslationScores:
    """The scores of ``hypotheses`` against the targets of ``pairs`` (UTF-8, invalid bytes replaced)."""
    require_sacrebleu()
    import sacrebleu

    text = [h.decode("utf-8", errors="replace") for h in hypotheses]
    refs = [[t.decode("utf-8", errors="replace") for _, t in pairs]]
    sources = [s.decode("utf-8", errors="replace") for s, _ in pairs]
    return TranslationScores(sacrebleu.corpus_chrf(text, refs).score, sacrebleu.corpus_bleu(text, refs).score,
                             sacrebleu.corpus_chrf(sources, refs).score, sacrebleu.corpus_bleu(sources, refs).score,
                             len(pairs))


@torch.no_grad()
def translate_all(model: Seq2SeqLM, sources: Sequence[bytes], *, batch: int = 64, beams: int = 1,
                  autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> list[bytes]:
    """Each source translated (greedy, or beam search with ``beams`` > 1), cut to the encoder's seq_len, at most
    the decoder's seq_len - 1 bytes out; in batches of similar lengths. O(sources · decoding)."""
    device = next(model.parameters()).device
    longest_in, longest_out = model.config.encoder.seq_len, model.config.decoder.seq_len - 1
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: list[bytes] = [b""] * len(sources)
    for at in range(0, len(order), batch):
        chosen = order[at:at + batch]
        pairs = [(sources[i][:longest_in], b"") for i in chosen]
        tensors = pair_batch(pairs)
        with autocast():
            ids = model.translate(tensors.source.to(device), longest_out, source_padding=tensors.source_padding.to(
                device), start=START, stop=START, beams=beams)
        for i, row in zip(chosen, ids.tolist(), strict=True):
            end = row.index(START) if START in row else len(row)
            out[i] = bytes(row[:end])
    return out


__all__ = ["TranslationScores", "require_sacrebleu", "score", "translate_all"]
