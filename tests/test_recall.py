"""The recall tasks' guarantees: the answer's source lies more than min_gap back, nothing near a scored position
names its answer, answers are uniform over as many choices as ``chance`` says, and batches follow their seed; and
`bench recall`'s reference: first in each task, trained with its curriculum, every row's yardstick, named when it
is not settled."""

import pytest
import torch

from routeformer.bench import recall
from routeformer.bench.recall import Curriculum, RecallSettings, Reference, Training
from routeformer.cli import build_parser, main
from routeformer.cli.bench import recall_reference
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


# `bench recall`'s reference: rows judged against full attention trained with a curriculum (tiny runs: what is
# checked is which models train on what and how the rows are computed from their scores, never a score).

TINY = RecallSettings(seq_len=32, gap=8, window=4, dim=16)  # local reach 2 × (4 - 1) = 6


def scores(monkeypatch, *accuracies: float) -> None:
    """Every model the bench scores gets the next of ``accuracies``, in training order."""
    it = iter(accuracies)
    monkeypatch.setattr(recall, "evaluate", lambda model, task, *, sequences: {"accuracy": next(it)})


def cells(lines: list[str], first: str) -> list[list[str]]:
    """The cells of every printed table line (the whole table is one echo) that starts with ``| first``."""
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in "\n".join(lines).splitlines() if line.startswith(f"| {first} ")]


def lengths_seen(monkeypatch) -> list[list[tuple[int, int]]]:
    """Per model the bench trains, the (batch, length) of every training step, seen by a forward pre-hook."""
    seen: list[list[tuple[int, int]]] = []
    real = recall.train

    def spy(model, task, **kwargs):
        seen.append([])
        hook = model.register_forward_pre_hook(lambda mod, args: seen[-1].append(tuple(args[0].shape)))
        try:
            return real(model, task, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(recall, "train", spy)
    return seen


def test_the_reference_comes_first_and_every_row_is_judged_against_it(monkeypatch):
    scores(monkeypatch, 0.8, 1.0, 0.45, 0.45, 0.9, 1.0)  # reference, local, full; seeds 0 and 1
    lines: list[str] = []
    rows = recall.run(["passkey"], ["local", "full"], TINY, Training(steps=4, batch=2, eval_sequences=4,
                                                                     seeds=(0, 1)), echo=lines.append)
    # the default curriculum: min(800, 4 // 2) steps at 32 // 4 (passkey fits at 8 with a gap of 6)
    assert [r["attention"] for r in rows] == ["reference: full (curriculum 2 at 8, seeds 0 1)", "local", "full"]
    assert rows[0]["seeds"] == [0.8, 1.0] and rows[0]["reference_seeds"] == {0: 0.8, 1: 1.0}
    for row in rows:
        assert row["reference"] == rows[0]["accuracy"] and row["reference_seeds"] == {0: 0.8, 1: 1.0}
        assert abs(row["vs_ref"] - row["accuracy"] / rows[0]["accuracy"]) < 1e-12 and "vs_first" not in row
    assert abs(rows[1]["vs_ref"] - 0.5) < 1e-12  # 0.45 against the reference's mean of 0.9
    assert cells(lines, "task") == [recall.HEADERS]
    printed = cells(lines, "passkey")  # row by row, then the whole table
    assert [row[1] for row in printed] == [r["attention"] for r in rows] * 2
    assert [row[4] for row in printed[3:]] == ["1.00", "0.50", "1.06"]  # vs ref: 0.9, 0.45 and 0.95 over 0.9
    assert rows[0]["train_flops"] < rows[2]["train_flops"]  # the same model; its curriculum's steps are shorter


def test_without_a_reference_the_ratio_is_over_the_first_row(monkeypatch):
    scores(monkeypatch, 0.8, 0.4)
    lines: list[str] = []
    rows = recall.run(["passkey"], ["full", "local"], TINY, Training(steps=2, batch=2, eval_sequences=4),
                      reference=None, echo=lines.append)
    assert [r["attention"] for r in rows] == ["full", "local"]
    assert rows[0]["vs_first"] == 1.0 and abs(rows[1]["vs_first"] - 0.5) < 1e-12
    assert all("vs_ref" not in r and "reference" not in r for r in rows)
    assert cells(lines, "task") == [recall.HEADERS_FIRST]
    assert not any("warning" in line for line in lines)
    args = build_parser().parse_args(["bench", "recall", "--reference", "none"])
    assert recall_reference(args) is None


def test_the_curriculum_trains_the_reference_on_shorter_sequences_first(monkeypatch):
    seen = lengths_seen(monkeypatch)
    recall.run(["passkey"], ["full"], TINY, Training(steps=5, batch=2, eval_sequences=4),
               reference=Reference(curriculum=Curriculum(3, 16)), echo=lambda *_: None)
    reference, full = seen
    assert reference == [(4, 16)] * 3 + [(2, 32)] * 2  # the batch cut into sequences of 16: the same tokens
    assert full == [(2, 32)] * 5  # the rows train as before


def test_the_default_curriculum_finds_the_shortest_length_the_task_fits(monkeypatch):
    seen = lengths_seen(monkeypatch)
    rows = recall.run(["mqar", "two_hop"], [], TINY, Training(steps=6, batch=2, eval_sequences=4),
                      echo=lambda *_: None)
    # mqar (4 facts, 2 queries, a gap of 6) does not fit at 8, does at 16; two_hop's two gaps fit nowhere below 32
    assert seen[0] == [(4, 16)] * 3 + [(2, 32)] * 3
    assert seen[1] == [(2, 32)] * 6
    assert [r["attention"] for r in rows] == ["reference: full (curriculum 3 at 16, seeds 0)",
                                              "reference: full (no curriculum, seeds 0)"]


def test_the_reference_takes_its_own_steps_and_seeds(monkeypatch):
    seen = lengths_seen(monkeypatch)
    rows = recall.run(["passkey"], ["local"], TINY, Training(steps=2, batch=2, eval_sequences=4),
                      reference=Reference(steps=4, seeds=(3, 4), curriculum=Curriculum(0)), echo=lambda *_: None)
    assert [len(steps) for steps in seen] == [4, 4, 2]  # two reference seeds of 4 steps, then the row's one seed
    assert rows[0]["attention"] == "reference: full (no curriculum, seeds 3 4)" and rows[0]["steps"] == 4
    assert set(rows[1]["reference_seeds"]) == {3, 4}


@pytest.mark.parametrize("accuracies, low", [((0.99, 0.90), "seed 1 reached 90.0%, more than 5 points below seed "
                                                             "0's 99.0%"),
                                             ((0.85, 0.84), "its best seed (0) reached 85.0%, under 90%"),
                                             ((0.99, 0.95), None)])
def test_an_unsettled_reference_is_named_with_its_seeds(monkeypatch, accuracies, low):
    scores(monkeypatch, *accuracies, 0.5, 0.5)
    lines: list[str] = []
    recall.run(["passkey"], ["local"], TINY, Training(steps=1, batch=2, eval_sequences=4, seeds=(0, 1)),
               echo=lines.append)
    warnings = [line for line in lines if line.startswith("warning:")]
    if low is None:
        assert warnings == []
        return
    assert warnings and all(w == warnings[0] for w in warnings)  # after the reference's row, and after the table
    assert "passkey" in warnings[0] and low in warnings[0] and "--reference-steps" in warnings[0]


def test_the_command_line_sets_the_reference():
    args = build_parser().parse_args(["bench", "recall", "--reference-curriculum", "10:16", "--reference-steps",
                                      "50", "--reference-seeds", "1", "2", "--reference", "local:2,full:2"])
    assert recall_reference(args) == Reference("local:2,full:2", steps=50, curriculum=Curriculum(10, 16),
                                               seeds=(1, 2))
    defaults = build_parser().parse_args(["bench", "recall"])
    assert recall_reference(defaults) == Reference()
    assert Curriculum.parse("0") == Curriculum(0) and Curriculum.parse("400") == Curriculum(400)


@pytest.mark.parametrize("argv, message", [
    (["--reference-curriculum", "ten:16"], "curriculum 'ten:16': write STEPS:LENGTH"),
    (["--reference", "none", "--reference-steps", "5"], "--reference none trains no reference: --reference-steps"),
    (["--steps", "4", "--reference-curriculum", "5:16"], "reference curriculum: 5 steps, more than the "
                                                         "reference's 4"),
    (["--tasks", "passkey", "--seq-len", "32", "--gap", "8", "--window", "4", "--steps", "4",
      "--reference-curriculum", "2:32"], "length 32 is not shorter than seq_len 32"),
    (["--tasks", "mqar", "--seq-len", "32", "--gap", "8", "--window", "4", "--reference-curriculum", "1:8"],
     "mqar does not fit at length 8"),
])
def test_reference_settings_that_cannot_work_are_refused(argv, message, capsys):
    try:
        code = main(["bench", "recall", "--steps", "1", *argv])
    except SystemExit as stop:  # argparse refuses a bad value itself
        code = stop.code
    assert code != 0
    assert message in capsys.readouterr().err
