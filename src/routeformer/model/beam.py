"""Beam search over a decoder's cache: each step scores the live hypotheses' next tokens once (one decoding step
of B · K rows), keeps the K best of every row's K · V continuations, and moves the cache's rows to follow them
(``reorder_rows``); no prefix is ever run again.

A hypothesis ends at the stop token. Finished hypotheses are ranked by their log-probability per token (the stop
included), and a row is done once it holds K of them (or at ``max_new_tokens``, the live ones then counted as
finished).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def reorder_rows(cache: object, index: Tensor) -> None:
    """Every per-sequence tensor of a decoding ``cache`` takes the rows ``index`` (B',) (rows of dim 0), in place
    (views of them stay views). A cache names those fields in ``ROWS``; lists and tuples are walked; a cache without
    ``ROWS`` is refused by name (its kind cannot follow beams yet). O(the cache's size)."""
    if cache is None:
        return
    if isinstance(cache, Tensor):
        cache.copy_(cache.index_select(0, index))
        return
    if isinstance(cache, (list, tuple)):
        for part in cache:
            reorder_rows(part, index)
        return
    rows = getattr(type(cache), "ROWS", None)
    if rows is None:
        raise ValueError(f"beam search: the decoding cache {type(cache).__name__} does not say which of its tensors "
                         f"hold one row per sequence (ROWS), so its rows cannot follow the beams")
    for name in rows:
        reorder_rows(getattr(cache, name), index)


@dataclass
class _Row:
    """One source's beam search: its finished hypotheses (score per token, tokens) and whether it is done."""

    finished: list[tuple[float, list[int]]]
    done: bool = False


def beam_search(step: Callable[[Tensor], Tensor], reorder: Callable[[Tensor], None], batch: int, beams: int,
                max_new_tokens: int, *, start: int, stop: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Tokens (batch, m) of each row's best hypothesis (its stop kept, then ``stop`` after it) and its score (the
    mean log-probability per token), m <= ``max_new_tokens``.

    ``step(tokens)``: (batch · beams, 1) next inputs -> (batch · beams, V) logits, over a cache of batch · beams
    rows (row b · beams + j: beam j of source b); ``reorder(index)``: the cache's rows take ``index``
    (batch · beams,) on ``device``. Work: max_new_tokens steps of batch · beams rows, plus the top 2K of K · V
    per row."""
    K = beams
    scores = torch.zeros(batch, K, dtype=torch.float64)
    scores[:, 1:] = -torch.inf  # the beams start equal: only the first one expands at the first step
    history = torch.zeros(batch * K, 0, dtype=torch.long)
    token = torch.full((batch * K, 1), start, dtype=torch.long)
    rows = [_Row([]) for _ in range(batch)]
    for t in range(max_new_tokens):
        logits = step(token.to(device))
        logp = torch.log_softmax(logits.double(), -1).cpu()  # (B·K, V)
        V = logp.shape[-1]
        total = (scores.reshape(-1, 1) + logp).view(batch, K * V)
        top, idx = total.topk(min(2 * K, K * V), dim=-1)  # enough that K survive after the stops
        origin, chosen = idx // V, idx % V
        keep_from = torch.arange(batch * K).view(batch, K).clone()  # rows the next step reads (done rows: any)
        keep_token = torch.full((batch, K), stop, dtype=torch.long)
        new_scores = torch.full((batch, K), -torch.inf, dtype=torch.float64)
        for b, row in enumerate(rows):
            if row.done:
                continue
            live = 0
            for score, o, c in zip(top[b].tolist(), origin[b].tolist(), chosen[b].tolist(), strict=True):
                if score == -torch.inf:
                    break
                if c == stop:
                    row.finished.append((score / (t + 1), history[b * K + o].tolist() + [c]))
                    continue
                if live < K:
                    keep_from[b, live], keep_token[b, live], new_scores[b, live] = b * K + o, c, score
                    live += 1
            row.done = len(row.finished) >= K or live == 0
        index = keep_from.view(-1)
        history = torch.cat([history.index_select(0, index), keep_token.view(-1, 1)], 1)
        scores, token = new_scores, keep_token.view(-1, 1)
        if all(row.done for row in rows):
            break
        reorder(index.to(device))
    for b, row in enumerate(rows):
        if not row.done:  # out of length: the live hypotheses count as finished
            for j in range(K):
                if scores[b, j] > -torch.inf:
                    row.finished.append((float(scores[b, j]) / history.shape[1], history[b * K + j].tolist()))
    best = [max(row.finished, key=lambda f: f[0]) for row in rows]
    m = max(len(tokens) for _, tokens in best)
    out = torch.full((batch, m), stop, dtype=torch.long)
    for b, (_, tokens) in enumerate(best):
        out[b, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return out.to(device), torch.tensor([s for s, _ in best], dtype=torch.float64)


__all__ = ["beam_search", "reorder_rows"]
