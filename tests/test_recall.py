"""The recall tasks' guarantees: the answer's source lies more than min_gap back, nothing near a scored position
names its answer, answers are uniform over as many choices as ``chance`` says, and batches follow their seed."""

import pytest
import torch

from routeformer.data.recall import IGNORE, TASKS, latest, mqar, one_hop, passkey, two_hop

SMALL = {"mqar": dict(seq_len=96, min_gap=24), "passkey": dict(seq_len=80, min_gap=30),
         "two_hop": dict(seq_len=128, min_gap=20), "latest": dict(seq_len=96, min_gap=24),
         "one_hop": dict(seq_len=96, min_gap=24, facts=6)}


def scored(batch):
    return [(b, t) for b, t in (batch.targets != IGNORE).nonzero().tolist()]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_same_seed_same_batch_other_seed_other_batch(name):
    task = TASKS[name](**SMALL[name])
    a, b, c = task.make(8, 3), task.make(8, 3), task.make(8, 4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.tokens, c.tokens)
    assert a.tokens.shape == (8, task.seq_len) and a.tokens.dtype == torch.long
    assert int(a.tokens.min()) >= 0 and int(a.tokens.max()) < task.vocab_size
    assert int(a.targets[a.targets != IGNORE].max()) < task.vocab_size


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_answer_lies_beyond_the_gap_and_nothing_near_names_it(name):
    task = TASKS[name](**SMALL[name])
    batch = task.make(64, 0)
    points = scored(batch)
    assert len(points) == 64 * task.answers_per_sequence
    for b, t in points:
        s = int(batch.sources[b, t])
        assert s >= 0 and t - s > task.min_gap
        answer = int(batch.targets[b, t])
        near = batch.tokens[b, t - task.min_gap:t + 1].tolist()
        if name == "one_hop":  # a value token names no key, so the answer's token may recur near the query as
            key = int(batch.tokens[b, t])  # an earlier query's answer, which belongs to another key
            assert int(batch.tokens[b, s - 1]) == key and int(batch.tokens[b, s]) == answer  # the fact: key, value
            assert key not in near[:-1]  # the query's key is not repeated near it, so neither is its fact
            values, q0 = range(6, 6 + 16), task.seq_len - 2 * task.answers_per_sequence  # SMALL: 6 keys, then values
            assert all(j > q0 and (j - q0) % 2 == 1  # the only values near: earlier queries' answers
                       for j, tok in enumerate(near, start=t - task.min_gap) if tok in values)
            continue
        assert answer not in near
        if name == "two_hop":  # the first hop's fact links the query to the b whose fact is the answer,
            fact = int(batch.tokens[b, s])  # which lies more than min_gap before it
            where = (batch.tokens[b] == answer).nonzero().flatten().tolist()
            assert where and all(s - w > task.min_gap for w in where if w < t)
            assert fact not in near
        else:
            assert int(batch.tokens[b, s]) == answer
    assert (batch.sources[batch.targets == IGNORE] == -1).all()


def test_latest_asks_for_the_last_value_written_to_the_key():
    """Written from the tokens alone: the answer is the last fact of the query's key before the queries, and
    other writes of that key (distractors with their own values) come before it."""
    task = latest(seq_len=96, min_gap=24, keys=3, writes=8)
    batch = task.make(200, 0)
    overwritten = 0
    for b, t in scored(batch):
        key = int(batch.tokens[b, t])
        facts = [(j, tok) for j, tok in enumerate(batch.tokens[b, :t - task.min_gap].tolist())
                 if 3 <= tok < 3 + 3 * 16 and (tok - 3) // 16 == key]
        assert facts and int(batch.targets[b, t]) == facts[-1][1] and int(batch.sources[b, t]) == facts[-1][0]
        overwritten += len(facts) > 1 and len({tok for _, tok in facts}) > 1
    assert overwritten > 100  # most queried keys were written more than once, with different values


@pytest.mark.parametrize("name", sorted(TASKS))
def test_given_the_query_answers_are_uniform_over_one_over_chance_choices(name):
    """What a window model sees at a scored position, its own token, leaves 1 / chance equally likely answers."""
    task = TASKS[name](**SMALL[name])
    batch = task.make(6000 // task.answers_per_sequence, 1)
    sel = batch.targets != IGNORE
    queries, answers = batch.tokens[sel], batch.targets[sel]
    choices = round(1 / task.chance)
    for query in queries.unique().tolist():
        values, counts = answers[queries == query].unique(return_counts=True)
        assert len(values) == choices
        expected = counts.sum().item() / choices
        assert (counts - expected).abs().max() < 5 * expected ** 0.5  # five standard deviations


def test_one_hop_answers_are_independent_of_the_earlier_query_answer():
    """Within the gap, the second query sees the first query's (key, value): values of distinct keys are drawn
    independently, so it is the second answer's token one time in ``values``, as chance says."""
    task = one_hop(seq_len=64, min_gap=16, facts=4, values=16)
    batch = task.make(6000, 2)
    first, second = batch.targets[:, -4], batch.targets[:, -2]
    same = int((first == second).sum())
    expected, sd = 6000 / 16, (6000 * (1 / 16) * (15 / 16)) ** 0.5
    assert abs(same - expected) < 5 * sd


def test_scored_positions_are_where_the_task_says():
    batch = passkey(seq_len=40, min_gap=10).make(16, 0)
    assert (batch.targets[:, -1] != IGNORE).all() and (batch.targets[:, :-1] == IGNORE).all()
    batch = mqar(seq_len=64, min_gap=16, queries=3).make(16, 0)
    assert (batch.targets[:, -6::2] != IGNORE).all() and (batch.targets[:, -6::2] == batch.tokens[:, -5::2]).all()
    batch = two_hop(seq_len=128, min_gap=16, queries=2).make(16, 0)
    assert (batch.targets[:, -4::2] == batch.tokens[:, -3::2]).all()
    batch = one_hop(seq_len=64, min_gap=16, facts=4, queries=3).make(16, 0)
    assert (batch.targets[:, -6::2] != IGNORE).all() and (batch.targets[:, -6::2] == batch.tokens[:, -5::2]).all()
    rows = torch.arange(16)[:, None]
    sources = batch.sources[:, -6::2]  # each answer's source is the value token right after its fact's key
    assert (batch.tokens[rows, sources] == batch.targets[:, -6::2]).all()
    assert (batch.tokens[rows, sources - 1] == batch.tokens[:, -6::2]).all()
    assert (batch.tokens[:, :-6] < 4).sum(1).eq(4).all()  # each of the 4 facts' keys once, before the queries


@pytest.mark.parametrize("bad, match", [
    (lambda: mqar(seq_len=20, min_gap=16), "mqar: seq_len 20 is too short"),
    (lambda: passkey(seq_len=10, min_gap=10), "passkey: seq_len 10 is too short"),
    (lambda: two_hop(seq_len=40, min_gap=16), "two_hop: seq_len 40 is too short"),
    (lambda: mqar(queries=5, keys=4), "queries"),
    (lambda: two_hop(links=0), "links must be a positive integer"),
    (lambda: latest(seq_len=40, min_gap=30), "latest: seq_len 40 is too short"),
    (lambda: latest(queries=3, writes=2), "latest needs queries"),
    (lambda: one_hop(seq_len=40, min_gap=21), "one_hop: seq_len 40 is too short"),
    (lambda: one_hop(facts=8, keys=4), "one_hop needs queries"),
    (lambda: passkey(min_gap=-1), "min_gap"),
    (lambda: passkey().make(0, 0), "batch_size"),
])
def test_bad_settings_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
