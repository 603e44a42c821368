"""Recall benchmark: does an attention mechanism reach, by content, what lies beyond every local window?

    routeformer bench recall [--tasks mqar passkey two_hop] [--attention full local local+routing] [--seeds 0 1]

Trains the same small model once per (task, attention, seed) for a fixed number of steps on batches generated on
the fly (``data/recall.py``: what an answer needs lies further back than depth × (window - 1), the reach of local
attention, so a local-only model stays at chance), then scores held-out batches.

Every task's rows are judged against a *reference* (``Reference``; default: full attention) trained until it is
reliable: on the same seeds, with a curriculum (``Curriculum``: its first steps on the batch cut into shorter
sequences, the task re-generated at that length, as routing's warm-up does), then at the full length. It is each
task's first row, and a line warns when it is not settled (a seed more than 5 points below its best, or a best
under 90%): a ratio against a model that stalled on a seed measures the stall, not the mechanism. Without a
reference (``reference=None``) the ratio is over the task's first row, as before.

Columns: accuracy on the scored positions (mean over the seeds, and each seed's), the accuracy over the
reference's (``vs ref``; ``vs first`` without one), the task's chance level, steps, seconds per step, the keys a
query scores (mean over heads of ``TransformerConfig.keys_per_query``, the attention cost), the training FLOPs
(``TransformerLM.training_flops``, a dense warm-up and the reference's curriculum included), and for routing heads
what they reached: cluster balance (keys in the largest cluster / mean), how often the key the answer needs is in a
cluster the query probes and how often it is within the query's window there (the first hop's key for ``two_hop``;
mean over routing heads, layers and seeds; with several probes, the share of each probe in parentheses).

A row is an attention spec, optionally followed by how routing heads route (``/shared``, ``/joint``,
``/separate``) and by config fields for that row:
``local+routing/separate@options.routing.probes=2@options.routing.warmup=400``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..attention.kinds import HeadGroup
from ..checks import positive_int
from ..data.recall import IGNORE, TASKS, RecallTask
from ..model import TransformerConfig, TransformerLM, local_window
from ..model.config import refuse_old_spelling
from ..train.config import FIELDS, TrainConfig, parse_override, set_field
from ..train.schedule import learning_rate
from .measure import executor_lines, format_table, merge_fields, notes

EVAL_SEED = 10**6  # held-out batches use seeds from here; training batches use seeds 0, 1, ...
CURRICULUM_STEPS = 800  # the reference's default curriculum: at most this many steps, half the run's at most
SETTLED_SPREAD = 0.05  # a settled reference: no seed more than 5 points below its best seed,
SETTLED_BEST = 0.90  # and a best seed of 90% or more


@dataclass(frozen=True)
class RecallSettings:
    """The tasks' and models' sizes. ``seq_len`` N; ``gap``: what an answer needs lies more than this before it
    (at least ``depth × (window - 1)``, the reach of local attention); ``facts``: mqar's and one_hop's facts (each
    with its own key); ``depth``, ``dim``, ``heads``: the model; ``window``: the local heads' (and rel_clip);
    ``num_clusters``, ``routing_window``: the routing heads' (None: their defaults)."""

    seq_len: int = 128
    gap: int = 32
    facts: int = 4
    depth: int = 2
    dim: int = 64
    heads: int = 4
    window: int = 8
    num_clusters: int | None = None
    routing_window: int | None = None

    @property
    def reach(self) -> int:
        """How far back local attention sees: depth × (window - 1)."""
        return self.depth * (self.window - 1)

    def task(self, name: str, seq_len: int | None = None) -> RecallTask:
        """Task ``name`` at the full length with the bench's gap, or at a shorter ``seq_len`` (a warm-up's or a
        curriculum's) with its gap just past local reach; a ValueError when it does not fit."""
        options = {"mqar": {"keys": self.facts}, "one_hop": {"facts": self.facts}}.get(name, {})
        if seq_len is None or seq_len == self.seq_len:
            return TASKS[name](seq_len=self.seq_len, min_gap=self.gap, **options)
        return TASKS[name](seq_len=seq_len, min_gap=self.reach, **options)


@dataclass(frozen=True)
class Training:
    """How every model trains and is scored: ``steps`` optimiser steps of ``batch`` sequences at peak learning rate
    ``lr`` (warm-up, cosine), then ``eval_sequences`` held-out sequences; once per seed of ``seeds`` (the model's
    initialisation; the batches are the same for every seed), on ``device``."""

    steps: int = 800
    batch: int = 32
    lr: float = 1e-3
    eval_sequences: int = 512
    seeds: tuple[int, ...] = (0,)
    device: str = "cpu"  # where the models train and are scored (the batches are made on the CPU, then moved)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        if not self.seeds:
            raise ValueError("seeds: give at least one")


@dataclass(frozen=True)
class Curriculum:
    """The first ``steps`` optimiser steps train on the batch cut into sequences of ``length`` tokens (the same
    tokens per step; the task re-generated at that length, its gap just past local reach), the rest at the full
    length. As a ``Reference``'s setting, None means the default: ``steps`` min(800, half the reference's steps),
    ``length`` a quarter of N, doubled until the task fits at it; ``steps`` 0: no curriculum."""

    steps: int | None = None
    length: int | None = None

    @classmethod
    def parse(cls, text: str) -> Curriculum:
        """'C:L', 'C' or 'C:' (length by default): C steps at length L; '0': none."""
        steps, _, length = text.partition(":")
        try:
            c = int(steps)
            n = int(length) if length.strip() else None
        except ValueError:
            raise ValueError(f"curriculum {text!r}: write STEPS:LENGTH (e.g. 800:32), STEPS alone for the default "
                             "length, or 0 for none") from None
        if c < 0 or (n is not None and n < 1):
            raise ValueError(f"curriculum {text!r}: steps must be >= 0 and the length positive")
        return cls(c, n)

    def resolved(self) -> tuple[int, int]:
        """(steps, length) of a curriculum a model trains with; a ValueError for a setting still to be resolved
        (``Reference.plan``)."""
        if self.steps is None or self.length is None:
            raise ValueError(f"{self} is a setting with defaults left to fill (Reference.plan resolves it for a "
                             "task): training needs its steps and its length")
        return self.steps, self.length

    def length_at(self, config: TransformerConfig, step: int) -> int:
        """The length to train at, step ``step``: the curriculum's while it lasts, or shorter if a warm-up of the
        model's own asks for it (``TransformerConfig.train_len``)."""
        steps, length = self.resolved()
        own = config.train_len(step)
        return min(own, length) if step < steps else own

    def describe(self) -> str:
        """'curriculum 800 at 32', the reference row's words for it."""
        steps, length = self.resolved()
        return f"curriculum {steps} at {length}"


@dataclass(frozen=True)
class Reference:
    """What every row is judged against: the attention row ``spec`` (as an ``attention`` row), trained for
    ``steps`` (None: the run's) on ``seeds`` (None: the run's) with ``curriculum``. Its mean accuracy over its
    seeds is the denominator of every row's ``vs ref``."""

    spec: str = "full"
    steps: int | None = None
    curriculum: Curriculum = field(default_factory=Curriculum)
    seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.steps is not None:
            positive_int("reference steps", self.steps)
        if self.seeds is not None:
            object.__setattr__(self, "seeds", tuple(self.seeds))
            if not self.seeds:
                raise ValueError("reference seeds: give at least one (or None for the run's)")

    def plan(self, settings: RecallSettings, training: Training, task: str) -> tuple[int, Curriculum | None]:
        """Its steps and the curriculum resolved for ``task`` (None: none), or a ValueError naming what does not
        fit."""
        steps = self.steps or training.steps
        c = self.curriculum
        first = min(CURRICULUM_STEPS, steps // 2) if c.steps is None else c.steps
        if first > steps:
            raise ValueError(f"reference curriculum: {first} steps, more than the reference's {steps} "
                             "(--reference-steps)")
        if first == 0:
            return steps, None
        if c.length is None:
            length = shortest_length(settings, task)
            return steps, None if length is None else Curriculum(first, length)
        if c.length >= settings.seq_len:
            raise ValueError(f"reference curriculum: length {c.length} is not shorter than seq_len "
                             f"{settings.seq_len}")
        try:
            settings.task(task, c.length)
        except ValueError as err:
            raise ValueError(f"reference curriculum: {task} does not fit at length {c.length} with a gap of "
                             f"{settings.reach} (local reach): {err}") from None
        return steps, Curriculum(first, c.length)


def shortest_length(settings: RecallSettings, task: str) -> int | None:
    """The default curriculum length for ``task``: N // 4, doubled until the task fits at that length with a gap
    just past local reach (``two_hop`` needs two gaps); None when no length below N fits."""
    n = settings.seq_len // 4
    while 0 < n < settings.seq_len:
        try:
            settings.task(task, n)
            return n
        except ValueError:
            n *= 2
    return None


# How routing heads route (options.routing settings), chosen by a row's suffix: 'local+routing/separate'.
ROUTING = {
    "shared": {"shared_qk": True, "separate": False},  # the paper's text models: keys are the queries
    "joint": {"shared_qk": False, "separate": False},  # one cluster per position, from n(q) + n(k)
    "separate": {"shared_qk": False, "separate": True},  # a query's probes from q, a key's cluster from k
}


def attention_config(name: str, heads: int) -> dict:
    """Config fields of a row: 'full', 'local', 'A+B' (two kinds, half the heads each: 'local+routing',
    'local+moba', ...) or any attention spec, optionally followed by '/shared', '/joint' or '/separate' (how routing
    heads route; default: the config's default) and by '@field=value' settings of the model config (values read as
    TOML), e.g. 'local+routing@options.routing.probes=1'."""
    head, *settings = name.split("@")
    spec, _, routing = head.partition("/")
    half = heads // 2
    pair = spec.split("+")
    if len(pair) == 2 and ":" not in spec and "," not in spec:
        spec = f"{pair[0]}:{heads - half},{pair[1]}:{half}"
    fields: dict = {"attention": spec}
    if routing:
        if routing not in ROUTING:
            raise ValueError(f"unknown routing variant {routing!r} in {name!r}; choose from {', '.join(ROUTING)}")
        fields["options"] = {"routing": dict(ROUTING[routing])}
    for item in settings:
        key, _, text = item.partition("=")
        key = key.strip()
        refuse_old_spelling({key: text}, f"{name!r}: '@{item}': ", f"@options.{{section}}.{{key}}={text.strip()}")
        if key not in FIELDS["model"] and not key.startswith("options."):
            raise ValueError(f"{name!r}: '@{item}' sets no model config field; valid fields: "
                             f"{', '.join(sorted(FIELDS['model']))}, options.<section>.<field>")
        table, key, value = parse_override(item)
        set_field(fields, key, value)
    return fields


def keys_per_query(config: TransformerConfig) -> float:
    """Mean over heads of the keys one query scores (``TransformerConfig.keys_per_query``, the attention cost)."""
    keys = config.keys_per_query()
    heads = [(keys[name], h) for layer in config.layer_specs() for name, h in layer]
    return sum(c * h for c, h in heads) / sum(h for _, h in heads)


def train(model: TransformerLM, task: RecallTask | Callable[[int], RecallTask], *, steps: int, batch: int,
          lr: float, warmup: int = 50, curriculum: Curriculum | None = None) -> float:
    """Train on batches of seeds 0 … steps - 1; returns seconds per step. ``task``: the task, or the task at each
    length, for warm-ups that train on shorter sequences (``TransformerConfig.train_len``) and for a
    ``curriculum`` (whatever the model's kind): those steps draw batch · seq_len / length sequences of that
    length, the same number of tokens."""
    at = task if callable(task) else (lambda n: task)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = TrainConfig(lr=lr, min_lr=0.0, warmup_steps=min(warmup, steps), max_steps=steps)  # warm-up, cosine
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate(s + 1, schedule) / lr)
    model.train()
    device = next(model.parameters()).device
    start = time.perf_counter()
    seq_len = model.config.seq_len
    for step in range(steps):
        n = model.config.train_len(step) if curriculum is None else curriculum.length_at(model.config, step)
        b = at(n).make(batch * seq_len // n, step)
        logits = model(b.tokens.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1), b.targets.to(device).flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        (loss + model.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        model.after_optimizer_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the steps' time, not their launches'
    return (time.perf_counter() - start) / steps


def training_flops(model: TransformerLM, steps: int, tokens_per_step: int, curriculum: Curriculum | None) -> float:
    """``TransformerLM.training_flops`` with a curriculum's steps counted at the length they train at."""
    if curriculum is None:
        return model.training_flops(steps, tokens_per_step)
    total, done = 0.0, 0
    short = curriculum.resolved()[0]
    for end in sorted({*(e for e in model.config.cost_changes() if e < steps), min(short, steps), steps}):
        if end > done:
            n = curriculum.length_at(model.config, done)
            total += (end - done) * tokens_per_step * model.flops_per_token(n, step=done)
            done = end
    return total


@torch.no_grad()
def evaluate(model: TransformerLM, task: RecallTask, *, sequences: int, batch: int = 64) -> dict[str, float]:
    """Accuracy on held-out batches, and what the head groups that report it (``HeadGroup.reach``: routing)
    reached (absent when none does)."""
    model.eval()
    device = next(model.parameters()).device
    seen: list[tuple[HeadGroup, torch.Tensor, torch.Tensor]] = []
    hooks = [g.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0], args[1])))
             for g in model.head_groups() if type(g).reach is not HeadGroup.reach]
    correct = total = 0
    reached: dict[str, list[torch.Tensor]] = {}
    try:
        for i in range(-(-sequences // batch)):
            b = task.make(min(batch, sequences - i * batch), EVAL_SEED + i)
            seen.clear()
            targets = b.targets.to(device)
            logits = model(b.tokens.to(device))
            scored = targets != IGNORE
            correct += int((logits.argmax(-1)[scored] == targets[scored]).sum())
            total += int(scored.sum())
            rows, cols = scored.nonzero(as_tuple=True)
            src = b.sources.to(device)[rows, cols]
            for group, q, k in seen:
                for key, value in group.reach(q, k, rows, cols, src).items():
                    reached.setdefault(key, []).append(value)
    finally:
        for h in hooks:
            h.remove()
    return {"accuracy": correct / total, **{key: float(torch.stack(v).mean()) for key, v in reached.items()}}


def run(tasks: Sequence[str], attentions: Sequence[str], settings: RecallSettings = RecallSettings(),
        training: Training = Training(), *, reference: Reference | None = Reference(), extra: dict | None = None,
        echo: Callable[[str], None] = print) -> list[dict]:
    """Train and score one model per (task, attention, seed), and first the task's ``reference`` (None: none, and
    the ratio is over the task's first row); print the table row by row, then whole, and a warning per task whose
    reference is not settled; return the rows. Every row carries ``vs_ref`` (its accuracy over the reference's),
    ``reference`` (the reference's mean accuracy) and ``reference_seeds`` (seed -> the reference's accuracy);
    without a reference, ``vs_first``. ``extra``: further TransformerConfig fields for every model
    (``positions``, ``options``, ...); a row's own settings come after the bench's, ``extra`` last (``options``
    merged section by section). ``echo``'s notes (``measure.Echo``): where the line naming the executor the models
    run on (on the CPU) goes, once every configuration is checked (the command line: stderr)."""
    for name in tasks:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; choose from {', '.join(sorted(TASKS))}")
    s = settings
    if s.gap < s.reach:
        raise ValueError(f"gap ({s.gap}) must be at least depth × (window - 1) = {s.reach}, the reach of local "
                         "attention, or a local-only model can see the answer and the benchmark would not test "
                         "long-range reach")
    built: dict[str, _Built] = {}
    for task_name in tasks:  # every task and every row's config, checked before anything trains
        task = s.task(task_name)
        routing = {key: value for key, value in (("num_clusters", s.num_clusters), ("window", s.routing_window))
                   if value is not None}
        base = merge_fields(dict(vocab_size=task.vocab_size, dim=s.dim, depth=s.depth, heads=s.heads,
                                 seq_len=s.seq_len, options={"routing": routing}), local_window(s.window))
        configs = [TransformerConfig(**merge_fields(base, attention_config(name, s.heads), extra or {}))
                   for name in attentions]
        plan = None
        if reference is not None:
            steps, curriculum = reference.plan(s, training, task_name)
            seeds = reference.seeds or training.seeds
            label = (f"reference: {reference.spec} ({curriculum.describe() if curriculum else 'no curriculum'}, "
                     f"seeds {' '.join(map(str, seeds))})")
            config = TransformerConfig(**merge_fields(base, attention_config(reference.spec, s.heads), extra or {}))
            plan = _Plan(reference.spec, label, config, steps, seeds, curriculum)
        # Warm-ups and the curriculum at a shorter length train on the task at that length, its gap just beyond
        # local reach.
        lengths = {c.train_len(0) for c in configs + ([plan.config] if plan else [])} - {s.seq_len}
        if plan and plan.curriculum:
            lengths.add(plan.curriculum.resolved()[1])
        built[task_name] = _Built(task, _at(task, {n: s.task(task_name, n) for n in lengths}), configs, plan)
    say = notes(echo)
    if say is not None:
        named = {name: config for b in built.values() for name, config in zip(attentions, b.configs, strict=True)}
        for b in built.values():  # the reference runs on an executor too (named by its spec)
            if b.reference is not None:
                named.setdefault(b.reference.spec, b.reference.config)
        for line in executor_lines({name: config.describe_executor(training.device)
                                    for name, config in named.items()}):
            say(line)
    t = training
    echo(f"# recall benchmark: N={s.seq_len}, gap>{s.gap}, mqar/one_hop facts={s.facts}, depth={s.depth}, "
         f"dim={s.dim}, heads={s.heads}, window={s.window}, steps={t.steps}, batch={t.batch}, lr={t.lr}, "
         f"seeds={' '.join(map(str, t.seeds))}, reference={_describe(reference, t)}, "
         f"{t.device}, threads={torch.get_num_threads()}")
    rows: list[dict] = []
    warnings: list[str] = []
    for task_name in tasks:
        b = built[task_name]
        mine: list[dict] = []
        if b.reference is not None:
            ref = b.reference
            row = _train_row(ref.label, ref.config, b, t, ref.steps, ref.seeds, ref.curriculum)
            row["reference_seeds"] = dict(zip(ref.seeds, row["seeds"], strict=True))
            mine.append(row)
            echo(table([{**row, **_ratio(row, row)}]).splitlines()[-1])
            warning = unsettled(task_name, ref.spec, row["reference_seeds"])
            if warning:
                warnings.append(warning)
                echo(warning)
        for name, config in zip(attentions, b.configs, strict=True):
            row = _train_row(name, config, b, t, t.steps, t.seeds, None)
            mine.append(row)
            echo(table([{**row, **_ratio(mine[0], row, reference is not None)}]).splitlines()[-1])
        for row in mine:
            row.update(_ratio(mine[0], row, reference is not None))
        rows += mine
    echo("")
    echo(table(rows))
    for warning in warnings:
        echo(warning)
    return rows


@dataclass(frozen=True)
class _Plan:
    """A task's reference, checked: its spec, its row's label, config, steps, seeds and curriculum (None: none)."""

    spec: str
    label: str
    config: TransformerConfig
    steps: int
    seeds: tuple[int, ...]
    curriculum: Curriculum | None


@dataclass(frozen=True)
class _Built:
    """One task's, checked: the task at the full length, the task at each length, the rows' configs and the
    reference's plan (None: no reference)."""

    task: RecallTask
    tasks_at: Callable[[int], RecallTask]
    configs: list[TransformerConfig]
    reference: _Plan | None


def _at(task: RecallTask, short: dict[int, RecallTask]) -> Callable[[int], RecallTask]:
    """The task at each length: ``short``'s at theirs, else ``task``."""
    return lambda n: short.get(n, task)


def _train_row(name: str, config: TransformerConfig, built: _Built, training: Training, steps: int,
               seeds: Sequence[int], curriculum: Curriculum | None) -> dict:
    """One row: a model per seed trained and scored; the mean accuracy and each seed's, and the costs."""
    results, times = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        model = TransformerLM(config).to(training.device)
        times.append(train(model, built.tasks_at, steps=steps, batch=training.batch, lr=training.lr,
                           curriculum=curriculum))
        results.append(evaluate(model, built.task, sequences=training.eval_sequences))
    tokens = training.batch * config.seq_len
    return {"task": built.task.name, "attention": name, "chance": built.task.chance, "steps": steps,
            "step_s": sum(times) / len(times), "keys_per_query": keys_per_query(config),
            "train_flops": training_flops(model, steps, tokens, curriculum), "heads": config.describe_heads(),
            "seeds": [r["accuracy"] for r in results],
            **{key: sum(r[key] for r in results) / len(results) for key in results[0]}}


def _ratio(first: dict, row: dict, reference: bool = True) -> dict:
    """``row``'s ratio to the task's first row: ``vs_ref`` with the reference's mean and seeds when ``first`` is
    the reference, else ``vs_first`` (None when the first row scored 0)."""
    ratio = row["accuracy"] / first["accuracy"] if first["accuracy"] else None
    if not reference:
        return {"vs_first": ratio}
    return {"vs_ref": ratio, "reference": first["accuracy"], "reference_seeds": dict(first["reference_seeds"])}


def unsettled(task: str, spec: str, seeds: dict[int, float]) -> str | None:
    """The warning line for a reference that is not settled (seed -> accuracy): a seed more than 5 points below
    its best seed, or a best seed under 90%; None when it is settled."""
    best = max(seeds, key=seeds.__getitem__)
    low = [seed for seed, accuracy in seeds.items() if seeds[best] - accuracy > SETTLED_SPREAD]
    problems = []
    if low:
        problems.append(", ".join(f"seed {seed} reached {_pct(seeds[seed])}%" for seed in low)
                        + f", more than {100 * SETTLED_SPREAD:.0f} points below seed {best}'s {_pct(seeds[best])}%")
    if seeds[best] < SETTLED_BEST:
        problems.append(f"its best seed ({best}) reached {_pct(seeds[best])}%, under {100 * SETTLED_BEST:.0f}%")
    if not problems:
        return None
    return (f"warning: {task}: the reference ({spec}) is not settled: {'; '.join(problems)}. The {task} rows' "
            "'vs ref' is against a model that has not learnt the task reliably: train the reference longer "
            "(--reference-steps) or give it a longer curriculum (--reference-curriculum)")


def _describe(reference: Reference | None, training: Training) -> str:
    """The header's words for the reference: 'full (800 steps, curriculum auto:auto)' or 'none'."""
    if reference is None:
        return "none"
    c = reference.curriculum
    seeds = "" if reference.seeds is None else f", seeds {' '.join(map(str, reference.seeds))}"
    return (f"{reference.spec} ({reference.steps or training.steps} steps, curriculum "
            f"{'auto' if c.steps is None else c.steps}:{'auto' if c.length is None else c.length}{seeds})")


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _per_probe(row: dict, key: str) -> str:
    """'58.0' for one probe; '58.0 (31.2+26.8)' for several (a key lies in one cluster: the shares add up)."""
    if key not in row:
        return "-"
    parts = [row[f"{key}_{t}"] for t in range(1, 100) if f"{key}_{t}" in row]
    total = _pct(row[key])
    return total if len(parts) <= 1 else f"{total} ({'+'.join(_pct(p) for p in parts)})"


HEADERS = ["task", "attention", "accuracy %", "seeds %", "vs ref", "chance %", "steps", "s/step", "keys/query",
           "train TFLOP", "balance", "in cluster %", "in window %", "head options"]
# Without a reference (--reference none) the ratio is over the task's first row.
HEADERS_FIRST = [("vs first" if h == "vs ref" else h) for h in HEADERS]


def table(rows: list[dict]) -> str:
    """The Markdown table of ``rows``: its ratio column ``vs ref``, or ``vs first`` for rows without a reference."""
    key = "vs_first" if rows and "vs_ref" not in rows[0] else "vs_ref"
    return format_table(
        HEADERS if key == "vs_ref" else HEADERS_FIRST,
        [[r["task"], r["attention"], _pct(r["accuracy"]), "/".join(_pct(a) for a in r["seeds"]),
          "-" if r[key] is None else f"{r[key]:.2f}", _pct(r["chance"]), r["steps"],
          f"{r['step_s']:.3f}", f"{r['keys_per_query']:.1f}", f"{r['train_flops'] / 1e12:.2f}",
          f"{r['balance']:.2f}" if "balance" in r else "-", _per_probe(r, "in_cluster"), _per_probe(r, "in_window"),
          r["heads"]]
         for r in rows])
