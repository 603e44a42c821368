"""Beam search: the search itself against exhaustive enumeration, and over a Seq2SeqLM's caches, whose rows must
follow the beams for every self-attention kind (the reported score equals the forward's log-probability of the
hypothesis it returns)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from routeformer.model.beam import beam_search, reorder_rows
from routeformer.model.seq2seq import Sampling, Seq2SeqConfig, Seq2SeqLM

STOP = 0


def markov(V: int, seed: int) -> torch.Tensor:
    """Log-probabilities (V + 1 previous tokens, V next): row V is the start."""
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(V + 1, V, generator=gen, dtype=torch.float64) * 2, -1)


def best_by_enumeration(table: torch.Tensor, max_len: int) -> tuple[float, list[int]]:
    """The hypothesis with the best log-probability per token: every sequence ending at STOP within max_len,
    and every sequence of max_len tokens without one."""
    V = table.shape[1]
    best = (-math.inf, [])
    for n in range(1, max_len + 1):
        for seq in itertools.product(range(V), repeat=n):
            if STOP in seq[:-1] or (n < max_len and seq[-1] != STOP):
                continue
            prev, total = V, 0.0
            for t in seq:
                total, prev = total + float(table[prev, t]), t
            best = max(best, (total / n, list(seq)))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_with_beams_enough_for_every_hypothesis_the_search_is_exhaustive(seed: int) -> None:
    V, L, B = 3, 4, 2
    tables = [markov(V, seed * 10 + b) for b in range(B)]
    K = V ** L
    state = torch.full((B * K,), V)  # each row's last token: the "cache" the reorder must move

    def step(tokens: torch.Tensor) -> torch.Tensor:
        state.copy_(torch.where(tokens[:, 0] == -1, state, tokens[:, 0]))
        return torch.stack([tables[r // K][int(state[r])] for r in range(B * K)])

    def reorder(index: torch.Tensor) -> None:
        reorder_rows(state, index)

    out, scores = beam_search(step, reorder, B, K, L, start=-1, stop=STOP, device=torch.device("cpu"))
    for b in range(B):
        want_score, want = best_by_enumeration(tables[b], L)
        got = out[b].tolist()
        got = got[:got.index(STOP) + 1] if STOP in got else got
        assert got == want and float(scores[b]) == pytest.approx(want_score, abs=1e-12)


def tiny_model(decoder_attention: str, options: dict, seed: int = 0) -> Seq2SeqLM:
    common = dict(vocab_size=256, dim=32, heads=4, positions="absolute", token_shift="half")
    config = Seq2SeqConfig(
        encoder=dict(common, depth=1, seq_len=16, attention="local:2,full:2", options={"local": {"window": 4}}),
        decoder=dict(common, depth=2, seq_len=16, attention=decoder_attention, options=options),
        cross="routing:2,full:2")
    torch.manual_seed(seed)
    model = Seq2SeqLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # peaked enough that beams diverge from greedy
    return model.eval()


@torch.no_grad()
def forward_score(model: Seq2SeqLM, source: torch.Tensor, padding: torch.Tensor, tokens: list[int]) -> float:
    """The forward's log-probability per token of ``tokens`` (cut after the stop) after the start byte."""
    seq = tokens[:tokens.index(STOP) + 1] if STOP in tokens else tokens
    target_in = torch.tensor([[STOP, *seq[:-1]]])
    logp = torch.log_softmax(model(source, target_in, padding).double(), -1)
    return float(logp[0].gather(-1, torch.tensor(seq)[:, None]).sum()) / len(seq)


@pytest.mark.parametrize(("attention", "options"), [
    ("local:2,full:2", {"local": {"window": 4}}),
    ("routing:2,local:2", {"local": {"window": 4}, "routing": {"num_clusters": 2, "window": 4}}),
    ("linear:2,performer:2", {}),
    ("lsh:4", {"lsh": {"buckets": 4, "window": 4}}),
    ("moba:4", {"moba": {"block": 4, "top_k": 2}}),
    ("fixed:4", {"fixed": {"block": 4, "summary": 1}}),
])
def test_beam_scores_equal_the_forward_s_for_every_self_attention_cache(attention: str, options: dict) -> None:
    model = tiny_model(attention, options)
    gen = torch.Generator().manual_seed(1)
    source = torch.randint(1, 256, (3, 10), generator=gen)
    padding = torch.ones(3, 10, dtype=torch.bool)
    padding[1, 6:] = False
    out, scores = model._beam_search(source, 12, padding, 4, (STOP, STOP))
    greedy = model.translate(source, 12, source_padding=padding)
    for b in range(3):
        got = forward_score(model, source[b:b + 1], padding[b:b + 1], out[b].tolist())
        assert got == pytest.approx(float(scores[b]), abs=1e-5)
        assert got >= forward_score(model, source[b:b + 1], padding[b:b + 1], greedy[b].tolist()) - 1e-6
    assert torch.equal(model.translate(source, 12, source_padding=padding, beams=4), out)


def test_beams_that_never_reorder_would_be_caught() -> None:
    """The score check above fails when the caches do not follow the beams (the reorder made a no-op)."""
    import routeformer.model.seq2seq as seq2seq

    model = tiny_model("local:2,full:2", {"local": {"window": 4}})
    source = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(2))
    padding = torch.ones(2, 10, dtype=torch.bool)
    original = seq2seq.reorder_rows
    try:
        seq2seq.reorder_rows = lambda cache, index: None
        out, scores = model._beam_search(source, 12, padding, 4, (STOP, STOP))
    finally:
        seq2seq.reorder_rows = original
    mismatch = [abs(forward_score(model, source[b:b + 1], padding[b:b + 1], out[b].tolist()) - float(scores[b]))
                for b in range(2)]
    assert max(mismatch) > 1e-3


def test_a_cache_that_names_no_rows_is_refused() -> None:
    class Opaque:
        tensor = torch.zeros(2, 3)

    with pytest.raises(ValueError, match="Opaque does not say which of its tensors hold one row per sequence"):
        reorder_rows([Opaque()], torch.tensor([1, 0]))


def test_beam_search_needs_greedy_choice_and_a_stop() -> None:
    model = tiny_model("local:2,full:2", {"local": {"window": 4}})
    source = torch.randint(1, 256, (1, 5))
    with pytest.raises(ValueError, match="beam search is deterministic and needs a stop token: no sampling"):
        model.translate(source, 4, beams=2, sampling=Sampling())
    with pytest.raises(ValueError, match="beams must be a positive integer"):
        model.translate(source, 4, beams=0)
