"""The key-value lookup task (issue 73): its batches say what the module says, and a model trains on them."""

from __future__ import annotations

import torch

from routeformer.bench.lookup import IGNORE, KEYS, VALUES, lookup_batch, run_lookup
from routeformer.model.seq2seq import Seq2SeqConfig


def test_a_batch_asks_every_key_once_and_its_answer_is_the_value_beside_it_in_the_source() -> None:
    b = lookup_batch(3, 10, torch.Generator().manual_seed(0))
    assert b.source.shape == b.target_in.shape == b.labels.shape == (3, 20)
    for row in range(3):
        keys, values = b.source[row, 0::2], b.source[row, 1::2]
        assert len(set(keys.tolist())) == 10 and all(k in KEYS for k in keys.tolist())
        assert all(v in VALUES for v in values.tolist())
        value_of = dict(zip(keys.tolist(), values.tolist(), strict=True))
        asked = b.target_in[row, 1::2]  # the decoder reads 0, q_1, a_1, q_2, …
        assert sorted(asked.tolist()) == sorted(keys.tolist())  # every key asked once
        assert b.labels[row, 1::2].tolist() == [value_of[q] for q in asked.tolist()]
        assert bool((b.labels[row, 0::2] == IGNORE).all()) and int(b.target_in[row, 0]) == 0
        assert b.target_in[row, 2::2].tolist() == b.labels[row, 1::2].tolist()[:-1]  # teacher forcing
    assert not torch.equal(b.target_in[:, 1::2], b.source[:, 0::2])  # another order than the source's


def test_run_lookup_trains_and_scores_held_out_batches() -> None:
    common = dict(vocab_size=256, dim=16, heads=2, positions="absolute")
    config = Seq2SeqConfig(encoder=dict(common, depth=1, seq_len=8, attention="full"),
                           decoder=dict(common, depth=1, seq_len=8, attention="full"), cross="routing:1,full:1",
                           cross_options={"routing": {"num_clusters": 2}})
    run = run_lookup(config, pairs=4, steps=3, batch=4, eval_batches=2)
    assert run.steps == 3 and 0.0 <= run.accuracy <= 1.0 and run.loss > 0 and run.seconds > 0
