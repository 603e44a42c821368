"""Synthetic long-range retrieval tasks, generated on the fly from a seed.

Each task is a batch of token sequences and, at a few *scored* positions, the token the model must predict next.
Every task is built so that what a scored position needs lies more than ``min_gap`` positions before it, and nothing
within ``min_gap`` of it says anything about the answer. A model whose only long-range reach is a local window of w
keys over L layers sees L·(w - 1) positions back, so with ``min_gap >= L·(w - 1)`` it cannot beat ``chance`` (one
over the number of answers it cannot tell apart, all equally likely); a model that retrieves by content can reach
100%.

Facts are single tokens, except ``one_hop``'s. A fact token names both a key and a value (token
``first + key · values + value``), so finding it is one attention hop by content. The classic form, a key token
followed by a value token (``one_hop``), also needs an induction circuit (a previous-token head, then a match on
what it copied): small models on a CPU budget learn that slowly (see docs/recall.md), so the other tasks, which
measure how attention *reaches*, do not hinge on it, and ``one_hop`` measures whether a mechanism also lets that
circuit form.

- ``mqar``: multi-query associative recall. ``facts`` facts with distinct keys early, filler, then ``queries`` queries:
  a key token, whose next token is its fact.
- ``one_hop``: the classic key-value form. ``facts`` (key token, value token) pairs with distinct keys early,
  filler, then ``queries`` queries: a key token, whose next token is its value.
- ``passkey``: one needle token (one of ``values``) hidden in filler; at the end a marker asks for it.
- ``latest``: recall with overwrites. Facts scattered in filler, a key written several times; a query asks for
  the value written last to its key (written for the routing hand-over study, not tuned on).
- ``two_hop``: chained recall. Facts b → c early, filler, facts a → b, filler, queries a: the answer is the fact
  (b → c) of the b that a points to, so one retrieval finds b and a second one finds c; the two facts are too far
  apart for one retrieval to see both.

Tokens are ``(B, N)`` longs; ``targets`` ``(B, N)`` hold the next token at scored positions and ``IGNORE`` (-1)
elsewhere, so ``cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)`` trains on the
answers alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..checks import positive_int

IGNORE = -1


@dataclass(frozen=True)
class RecallBatch:
    """tokens (B, N); targets (B, N), ``IGNORE`` except at scored positions; sources (B, N): at a scored position,
    the position of the token its answer must be retrieved from (the first hop's, for ``two_hop``), else -1."""

    tokens: Tensor
    targets: Tensor
    sources: Tensor


Row = tuple[Tensor, Tensor, Tensor]


@dataclass(frozen=True)
class RecallTask:
    """A task: its name, vocabulary, length, guaranteed gap, chance level and generator.

    ``make(batch_size, seed)`` returns a ``RecallBatch``; the same task, batch size and seed always give the same
    batch. ``answers_per_sequence``: scored positions per sequence. ``hops``: retrievals an answer needs (so
    attention layers a model needs at least).
    """

    name: str
    seq_len: int
    min_gap: int
    vocab_size: int
    chance: float
    answers_per_sequence: int
    hops: int
    generate: Callable[[torch.Generator], Row] = field(repr=False, compare=False)

    def make(self, batch_size: int, seed: int) -> RecallBatch:
        positive_int("batch_size", batch_size)
        gen = torch.Generator().manual_seed(int(seed))
        rows = [self.generate(gen) for _ in range(batch_size)]
        return RecallBatch(*(torch.stack(parts) for parts in zip(*rows, strict=True)))


def _check_length(task: str, seq_len: int, min_gap: int, used: int, what: str) -> int:
    """Free positions left over (>= 0) once ``used`` positions and the gaps are placed."""
    positive_int("seq_len", seq_len)
    if not isinstance(min_gap, int) or isinstance(min_gap, bool) or min_gap < 0:
        raise ValueError(f"min_gap must be a non-negative integer, got {min_gap!r}")
    free = seq_len - used
    if free < 0:
        raise ValueError(f"{task}: seq_len {seq_len} is too short for {what}; it needs at least {used}")
    return free


def _fill(n: int, first: int, count: int, gen: torch.Generator) -> Tensor:
    return torch.randint(first, first + count, (n,), generator=gen)


def _randint(low: int, high: int, gen: torch.Generator) -> int:
    """A random integer in [low, high]."""
    return low + int(torch.randint(high - low + 1, (1,), generator=gen))


def mqar(seq_len: int = 256, min_gap: int = 64, keys: int = 4, values: int = 16, facts: int | None = None,
         queries: int = 2, filler: int = 64) -> RecallTask:
    """Multi-query associative recall.

    Layout: filler; ``facts`` fact tokens (distinct keys, values uniform) side by side at a random offset; filler;
    then ``queries`` (key, fact) pairs over distinct keys of the facts, the last ending the sequence. Scored: each
    query key, whose next token is its fact. The last fact lies more than ``min_gap`` positions before the first
    query. Vocabulary: keys [0, keys), facts [keys, keys + keys · values), filler after them. Chance: 1 / values
    (a model that cannot see the facts knows the key, not the value).
    """
    keys, values, queries, filler = (positive_int(n, x) for n, x in
                                     [("keys", keys), ("values", values), ("queries", queries), ("filler", filler)])
    facts = keys if facts is None else positive_int("facts", facts)
    if not queries <= facts <= keys:
        raise ValueError(f"mqar needs queries ({queries}) <= facts ({facts}) <= keys ({keys})")
    free = _check_length("mqar", seq_len, min_gap, facts + 2 * queries + min_gap,
                         f"{facts} facts, {queries} queries and a gap of {min_gap}")
    first_fact, first_filler = keys, keys + keys * values

    def generate(gen: torch.Generator) -> Row:
        tokens = _fill(seq_len, first_filler, filler, gen)
        k = torch.randperm(keys, generator=gen)[:facts]
        fact = first_fact + k * values + torch.randint(values, (facts,), generator=gen)
        start = _randint(0, free, gen)
        tokens[start:start + facts] = fact
        asked = torch.randperm(facts, generator=gen)[:queries]
        q0 = seq_len - 2 * queries
        tokens[q0::2], tokens[q0 + 1::2] = k[asked], fact[asked]
        targets, sources = torch.full((seq_len,), IGNORE), torch.full((seq_len,), -1)
        targets[q0::2], sources[q0::2] = fact[asked], start + asked
        return tokens, targets, sources

    return RecallTask("mqar", seq_len, min_gap, first_filler + filler, 1.0 / values, queries, 1, generate)


def one_hop(seq_len: int = 128, min_gap: int = 64, facts: int = 8, keys: int | None = None, values: int = 16,
            queries: int = 2, filler: int = 64) -> RecallTask:
    """One-hop key-value recall in the classic form: a fact is two tokens, a key then its value.

    Layout: filler; ``facts`` (key, value) pairs (distinct keys drawn from ``keys``, default ``facts``; values
    uniform over ``values``, independently) side by side at a random offset; filler; then ``queries`` (key, value)
    pairs over distinct keys of the facts, the last ending the sequence. Scored: each query key, whose next token is
    its value; its source is the fact's value token (what attention must reach), which lies more than ``min_gap``
    positions before the first query. Within ``min_gap`` of a query lie filler and the earlier queries, whose
    values belong to other keys and are drawn independently: they say nothing about the answer. Vocabulary: keys
    [0, keys), values [keys, keys + values), filler after. Chance: 1 / values.

    Unlike the other tasks a value token does not name its key: the model must tie each value to the key before it
    (a previous-token head) and then match the query on that (an induction circuit).
    """
    facts, values, queries, filler = (positive_int(n, x) for n, x in
                                      [("facts", facts), ("values", values), ("queries", queries), ("filler", filler)])
    keys = facts if keys is None else positive_int("keys", keys)
    if not queries <= facts <= keys:
        raise ValueError(f"one_hop needs queries ({queries}) <= facts ({facts}) <= keys ({keys})")
    free = _check_length("one_hop", seq_len, min_gap, 2 * facts + 2 * queries + min_gap,
                         f"{facts} facts of two tokens, {queries} queries and a gap of {min_gap}")
    first_value, first_filler = keys, keys + values

    def generate(gen: torch.Generator) -> Row:
        tokens = _fill(seq_len, first_filler, filler, gen)
        k = torch.randperm(keys, generator=gen)[:facts]
        value = first_value + torch.randint(values, (facts,), generator=gen)
        start = _randint(0, free, gen)
        tokens[start:start + 2 * facts:2], tokens[start + 1:start + 2 * facts:2] = k, value
        asked = torch.randperm(facts, generator=gen)[:queries]
        q0 = seq_len - 2 * queries
        tokens[q0::2], tokens[q0 + 1::2] = k[asked], value[asked]
        targets, sources = torch.full((seq_len,), IGNORE), torch.full((seq_len,), -1)
        targets[q0::2], sources[q0::2] = value[asked], start + 2 * asked + 1
        return tokens, targets, sources

    return RecallTask("one_hop", seq_len, min_gap, first_filler + filler, 1.0 / values, queries, 1, generate)


def passkey(seq_len: int = 256, min_gap: int = 64, values: int = 16, filler: int = 64) -> RecallTask:
    """Passkey retrieval: one needle token (one of ``values``) at a random position in filler; the sequence ends
    with a marker, whose next token is the needle. The needle lies more than ``min_gap`` positions before the
    marker. Vocabulary: needles [0, values), the marker ``values``, filler after. Chance: 1 / values."""
    values, filler = positive_int("values", values), positive_int("filler", filler)
    free = _check_length("passkey", seq_len, min_gap, 2 + min_gap, f"a needle and a gap of {min_gap}")
    mark = values

    def generate(gen: torch.Generator) -> Row:
        tokens = _fill(seq_len, mark + 1, filler, gen)
        needle = int(torch.randint(values, (1,), generator=gen))
        where = _randint(0, free, gen)
        tokens[where], tokens[-1] = needle, mark
        targets, sources = torch.full((seq_len,), IGNORE), torch.full((seq_len,), -1)
        targets[-1], sources[-1] = needle, where
        return tokens, targets, sources

    return RecallTask("passkey", seq_len, min_gap, mark + 1 + filler, 1.0 / values, 1, 1, generate)


def two_hop(seq_len: int = 256, min_gap: int = 64, links: int = 4, values: int = 16, queries: int = 2,
            filler: int = 64) -> RecallTask:
    """Two-hop recall over ``links`` entities a and ``links`` entities b.

    Each sequence draws a random one-to-one map π from the a's to the b's and a value c_b for every b. Layout:
    filler; the facts (b → c_b) side by side in random order; more than ``min_gap`` of filler; the facts
    (a → π(a)) side by side in random order; more than ``min_gap`` of filler; then ``queries`` pairs (a, answer)
    over distinct a's, the last ending the sequence. Scored: each query a, whose next token is the fact
    (π(a) → c_π(a)). Finding it needs the fact (a → π(a)) first: neither fact is within ``min_gap`` of the query,
    nor the first fact within ``min_gap`` of the second. Vocabulary: entities a [0, links), facts a → b
    [links, links + links²), facts b → c next (links · values of them), filler after. Chance: 1 / (links · values)
    without either fact; one hop alone reaches 1 / values.
    """
    links, values, queries, filler = (positive_int(n, x) for n, x in
                                      [("links", links), ("values", values), ("queries", queries), ("filler", filler)])
    if queries > links:
        raise ValueError(f"two_hop needs queries ({queries}) <= links ({links})")
    free = _check_length("two_hop", seq_len, min_gap, 2 * links + 2 * queries + 2 * min_gap,
                         f"{links} links, {queries} queries and two gaps of {min_gap}")
    first_ab, first_bc = links, links + links * links
    first_filler = first_bc + links * values

    def generate(gen: torch.Generator) -> Row:
        tokens = _fill(seq_len, first_filler, filler, gen)
        pi = torch.randperm(links, generator=gen)  # a -> b
        c = torch.randint(values, (links,), generator=gen)  # b -> c
        ab = first_ab + torch.arange(links) * links + pi  # fact of a
        bc = first_bc + torch.arange(links) * values + c  # fact of b
        # The free positions are shared out between the leading filler and the two gaps.
        cuts = sorted(int(x) for x in torch.randint(free + 1, (2,), generator=gen))
        start_bc = cuts[0]
        start_ab = start_bc + links + min_gap + cuts[1] - cuts[0]
        order_bc, order_ab = torch.randperm(links, generator=gen), torch.randperm(links, generator=gen)
        tokens[start_bc:start_bc + links] = bc[order_bc]
        tokens[start_ab:start_ab + links] = ab[order_ab]
        asked = torch.randperm(links, generator=gen)[:queries]
        q0 = seq_len - 2 * queries
        answer = bc[pi[asked]]
        tokens[q0::2], tokens[q0 + 1::2] = asked, answer
        where_ab = torch.empty(links, dtype=torch.long)
        where_ab[order_ab] = torch.arange(links)
        targets, sources = torch.full((seq_len,), IGNORE), torch.full((seq_len,), -1)
        targets[q0::2], sources[q0::2] = answer, start_ab + where_ab[asked]
        return tokens, targets, sources

    return RecallTask("two_hop", seq_len, min_gap, first_filler + filler, 1.0 / (links * values), queries, 2,
                      generate)


def latest(seq_len: int = 256, min_gap: int = 64, keys: int = 4, values: int = 16, writes: int = 8,
           queries: int = 2, filler: int = 64) -> RecallTask:
    """Associative recall with overwrites: the latest value written to a key.

    Layout: ``writes`` fact tokens scattered at random positions among filler (keys drawn with repeats, so a key
    is often written several times with different values); more than ``min_gap`` of filler; then ``queries``
    (key, fact) pairs over distinct written keys, the last ending the sequence. Scored: each query key, whose next
    token is the *last* fact written to it (the earlier ones are distractors of the same key). Vocabulary as
    ``mqar``'s: keys [0, keys), facts [keys, keys + keys · values), filler after. Chance: 1 / values.
    """
    keys, values, writes, queries, filler = (positive_int(n, x) for n, x in [
        ("keys", keys), ("values", values), ("writes", writes), ("queries", queries), ("filler", filler)])
    if not queries <= min(keys, writes):
        raise ValueError(f"latest needs queries ({queries}) <= keys ({keys}) and <= writes ({writes})")
    free = _check_length("latest", seq_len, min_gap, writes + 2 * queries + min_gap,
                         f"{writes} writes, {queries} queries and a gap of {min_gap}")
    region = writes + free  # the writes lie in [0, region): the first query is more than min_gap after
    first_fact, first_filler = keys, keys + keys * values

    def generate(gen: torch.Generator) -> Row:
        tokens = _fill(seq_len, first_filler, filler, gen)
        where = torch.randperm(region, generator=gen)[:writes].sort().values
        written = torch.randint(keys, (writes,), generator=gen)
        while len(written.unique()) < queries:  # rare: too few distinct keys to ask about
            written = torch.randint(keys, (writes,), generator=gen)
        fact = first_fact + written * values + torch.randint(values, (writes,), generator=gen)
        tokens[where] = fact
        choices = written.unique()
        asked = choices[torch.randperm(len(choices), generator=gen)[:queries]]
        last = torch.stack([(written == a).nonzero().max() for a in asked.tolist()])  # the latest write of each
        q0 = seq_len - 2 * queries
        tokens[q0::2], tokens[q0 + 1::2] = asked, fact[last]
        targets, sources = torch.full((seq_len,), IGNORE), torch.full((seq_len,), -1)
        targets[q0::2], sources[q0::2] = fact[last], where[last]
        return tokens, targets, sources

    return RecallTask("latest", seq_len, min_gap, first_filler + filler, 1.0 / values, queries, 1, generate)


TASKS: dict[str, Callable[..., RecallTask]] = {"mqar": mqar, "passkey": passkey, "two_hop": two_hop,
                                               "latest": latest, "one_hop": one_hop}
