"""``analysis.seq2seq.routed_reading``: what an encoder-decoder model's routing heads read, and their recall of
their own dense attention."""

from __future__ import annotations

import pytest
import torch

from routeformer.analysis.seq2seq import format_reading, routed_reading
from routeformer.model.seq2seq import Seq2SeqConfig, Seq2SeqLM

PAIRS = [(b"open the file", b"die Datei \xc3\xb6ffnen"), (b"save all", b"alle speichern"), (b"x", b"y")]


def model_of(enc_routing: dict, cross_routing: dict) -> Seq2SeqLM:
    common = dict(vocab_size=256, dim=32, heads=4, positions="absolute")
    config = Seq2SeqConfig(
        encoder=dict(common, depth=2, seq_len=24, attention="local:2,routing:2",
                     options={"local": {"window": 4}, "routing": enc_routing}),
        decoder=dict(common, depth=1, seq_len=24, attention="full"),
        cross="routing:3,full:1", cross_options={"routing": cross_routing})
    torch.manual_seed(0)
    model = Seq2SeqLM(config)
    model.train()
    for _ in range(2):  # seed the centroids from the routing vectors, as training does
        model(torch.randint(1, 256, (4, 24)), torch.randint(1, 256, (4, 24)))
        model.after_optimizer_step()
    return model


def test_heads_that_read_every_key_recall_all_of_their_dense_attention():
    model = model_of({"num_clusters": 1, "window": 24, "probes": 1, "balance": 0.0},
                     {"num_clusters": 2, "probes": 1, "window": 24})  # windows as long as the sequences
    rows = routed_reading(model, PAIRS, local_window=4)
    assert [(r.stack, r.layer, r.heads) for r in rows] == [("encoder", 0, range(2, 4)), ("encoder", 1, range(2, 4)),
                                                           ("cross", 0, range(0, 3))]
    for r in rows:
        assert r.recall == pytest.approx(1.0, abs=1e-9)  # every key it could read
    sources = [len(s) for s, _ in PAIRS]  # 13, 8, 1 bytes: an encoder query reads every other key (routing's rule)
    assert rows[0].available == pytest.approx(sum(n * n for n in sources) / sum(sources))
    assert rows[0].keys == pytest.approx(sum(max(1, n * (n - 1)) for n in sources) / sum(sources))
    targets = [len(t) + 1 for _, t in PAIRS]  # a cross query reads every source key
    assert rows[-1].keys == rows[-1].available == pytest.approx(sum(t * s for t, s in zip(targets, sources,
                                                                                          strict=True)) / sum(targets))
    assert 0 < rows[0].beyond < 1 and rows[-1].beyond is None
    assert model.training  # left as it was


def test_heads_that_read_a_part_recall_less_and_the_table_says_so():
    model = model_of({"num_clusters": 4, "window": 4, "probes": 1, "balance": 0.0}, {"num_clusters": 4, "probes": 1})
    rows = routed_reading(model, PAIRS, local_window=4)
    for r in rows:
        assert r.keys < r.available and 0 < r.recall < 1
    table = format_reading(rows, "toy")
    assert "what the routing heads read: toy" in table and len(table.splitlines()) == 3 + len(rows) + 1
    with pytest.raises(ValueError, match="at least one pair"):
        routed_reading(model, [])
