"""Recall benchmark: does an attention mechanism reach, by content, what lies beyond every local window?

    routeformer bench recall [--tasks mqar passkey two_hop] [--attention full local local+routing] [--seeds 0 1]

Trains the same small model once per (task, attention, seed) for a fixed number of steps on batches generated on
the fly (``data/recall.py``: what an answer needs lies further back than depth × (window - 1), the reach of local
attention, so a local-only model stays at chance), then scores held-out batches. Columns: accuracy on the scored
positions (mean over the seeds, and each seed's), the accuracy over the task's first row's (the baseline: full
attention in the default list), the task's chance level, steps, seconds per step, the keys a query scores (mean
over heads of ``TransformerConfig.keys_per_query``, the attention cost), the training FLOPs
(``TransformerLM.training_flops``, a dense warm-up included), and for routing heads what they reached: cluster
balance (keys in the largest cluster / mean), how often the key the answer needs is in a cluster the query probes
and how often it is within the query's window there (the first hop's key for ``two_hop``; mean over routing heads,
layers and seeds; with several probes, the share of each probe in parentheses).

A row is an attention spec, optionally followed by how routing heads route (``/shared``, ``/joint``,
``/separate``) and by config fields for that row:
``local+routing/separate@options.routing.probes=2@options.routing.warmup=400``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..attention.kinds import HeadGroup
from ..data.recall import IGNORE, TASKS, RecallTask
from ..model import TransformerConfig, TransformerLM
from ..model.config import MOVED, old_spelling_error
from ..train.config import FIELDS, TrainConfig, parse_override, set_field
from ..train.schedule import learning_rate
from .measure import executor_lines, format_table, merge_fields, notes

EVAL_SEED = 10**6  # held-out batches use seeds from here; training batches use seeds 0, 1, ...


# How routing heads route (options.routing settings), chosen by a row's suffix: 'local+routing/separate'.
ROUTING = {
    "shared": {"shared_qk": True, "separate": False},  # the paper's text models: keys are the queries
    "joint": {"shared_qk": False, "separate": False},  # one cluster per position, from n(q) + n(k)
    "separate": {"shared_qk": False, "separate": True},  # a query's probes from q, a key's cluster from k
}


def attention_config(name: str, heads: int) -> dict:
    """Config fields of a row: 'full', 'local', 'local+routing' (half and half) or any attention spec, optionally
    followed by '/shared', '/joint' or '/separate' (how routing heads route; default: the config's default) and by
    '@field=value' settings of the model config (values read as TOML), e.g.
    'local+routing@options.routing.probes=1'."""
    head, *settings = name.split("@")
    spec, _, routing = head.partition("/")
    half = heads // 2
    fields: dict = {"attention": {"local+routing": f"local:{heads - half},routing:{half}"}.get(spec, spec)}
    if routing:
        if routing not in ROUTING:
            raise ValueError(f"unknown routing variant {routing!r} in {name!r}; choose from {', '.join(ROUTING)}")
        fields["options"] = {"routing": dict(ROUTING[routing])}
    for item in settings:
        key, _, text = item.partition("=")
        key = key.strip()
        if key in MOVED:
            raise old_spelling_error(key, f"{name!r}: '@{item}': ", f"@options.{{section}}.{{key}}={text.strip()}")
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
          lr: float, warmup: int = 50) -> float:
    """Train on batches of seeds 0 … steps - 1; returns seconds per step. ``task``: the task, or the task at each
    length, for warm-ups that train on shorter sequences (``TransformerConfig.train_len``): those steps draw
    batch · seq_len / length sequences of that length, the same number of tokens."""
    at = task if callable(task) else (lambda n: task)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = TrainConfig(lr=lr, min_lr=0.0, warmup_steps=min(warmup, steps), max_steps=steps)  # warm-up, cosine
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate(s + 1, schedule) / lr)
    model.train()
    start = time.perf_counter()
    seq_len = model.config.seq_len
    for step in range(steps):
        n = model.config.train_len(step)
        b = at(n).make(batch * seq_len // n, step)
        logits = model(b.tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        (loss + model.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        model.after_optimizer_step(step)
    return (time.perf_counter() - start) / steps


@torch.no_grad()
def evaluate(model: TransformerLM, task: RecallTask, *, sequences: int, batch: int = 64) -> dict[str, float]:
    """Accuracy on held-out batches, and what the head groups that report it (``HeadGroup.reach``: routing)
    reached (absent when none does)."""
    model.eval()
    seen: list[tuple[HeadGroup, torch.Tensor, torch.Tensor]] = []
    hooks = [g.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0], args[1])))
             for g in model.head_groups() if type(g).reach is not HeadGroup.reach]
    correct = total = 0
    reached: dict[str, list[torch.Tensor]] = {}
    try:
        for i in range(-(-sequences // batch)):
            b = task.make(min(batch, sequences - i * batch), EVAL_SEED + i)
            seen.clear()
            logits = model(b.tokens)
            scored = b.targets != IGNORE
            correct += int((logits.argmax(-1)[scored] == b.targets[scored]).sum())
            total += int(scored.sum())
            rows, cols = scored.nonzero(as_tuple=True)
            src = b.sources[rows, cols]
            for group, q, k in seen:
                for key, value in group.reach(q, k, rows, cols, src).items():
                    reached.setdefault(key, []).append(value)
    finally:
        for h in hooks:
            h.remove()
    return {"accuracy": correct / total, **{key: float(torch.stack(v).mean()) for key, v in reached.items()}}


def run(tasks: list[str], attentions: list[str], *, seq_len: int = 128, gap: int = 32, facts: int = 4, depth: int = 2,
        dim: int = 64, heads: int = 4, window: int = 8, num_clusters: int | None = None,
        routing_window: int | None = None, steps: int = 800, batch: int = 32,
        lr: float = 1e-3, eval_sequences: int = 512, seeds: list[int] | tuple[int, ...] = (0,),
        extra: dict | None = None, echo: Callable[[str], None] = print) -> list[dict]:
    """Train and score one model per (task, attention, seed); print the table row by row, then whole; return the rows.
    ``facts``: mqar's facts (each with its own key). ``window``: the local heads' (and rel_clip); ``num_clusters``,
    ``routing_window``: the routing heads' (None: their defaults). ``extra``: further TransformerConfig fields for every
    model (``positions``, ``options``, ...); a row's own settings come after the bench's, ``extra`` last (``options``
    merged section by section). ``echo``'s notes (``measure.Echo``): where the line naming the executor the models run
    on (on the CPU) goes, once every configuration is checked (the command line: stderr)."""
    for name in tasks:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; choose from {', '.join(sorted(TASKS))}")
    if gap < depth * (window - 1):
        raise ValueError(f"gap ({gap}) must be at least depth × (window - 1) = {depth * (window - 1)}, the reach of "
                         "local attention, or a local-only model can see the answer and the benchmark would not test "
                         "long-range reach")
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds: give at least one")
    built = {}
    for task_name in tasks:  # every task and every row's config, checked before anything trains
        options = {"keys": facts} if task_name == "mqar" else {}
        task = TASKS[task_name](seq_len=seq_len, min_gap=gap, **options)
        routing = {key: value for key, value in (("num_clusters", num_clusters), ("window", routing_window))
                   if value is not None}
        base = dict(vocab_size=task.vocab_size, dim=dim, depth=depth, heads=heads, seq_len=seq_len, rel_clip=window,
                    options={"local": {"window": window}, "longformer": {"window": window}, "routing": routing})
        configs = [TransformerConfig(**merge_fields(base, attention_config(name, heads), extra or {}))
                   for name in attentions]
        # Warm-ups at a shorter length train on the task at that length, its gap just beyond local reach.
        lengths = {c.train_len(0) for c in configs} - {seq_len}
        short = {n: TASKS[task_name](seq_len=n, min_gap=depth * (window - 1), **options) for n in lengths}
        built[task_name] = (lambda n, task=task, short=short: short.get(n, task)), configs
    say = notes(echo)
    if say is not None:
        for line in executor_lines({name: config.describe_executor("cpu") for _, configs in built.values()
                                    for name, config in zip(attentions, configs, strict=True)}):
            say(line)
    echo(f"# recall benchmark: N={seq_len}, gap>{gap}, mqar facts={facts}, depth={depth}, dim={dim}, heads={heads}, "
         f"window={window}, steps={steps}, batch={batch}, lr={lr}, seeds={' '.join(map(str, seeds))}, "
         f"threads={torch.get_num_threads()}")
    rows: list[dict] = []
    for task_name in tasks:
        tasks_at, configs = built[task_name]
        task = tasks_at(seq_len)
        first = None  # the task's first row (full attention in the default list) is the baseline
        for name, config in zip(attentions, configs, strict=True):
            results, times = [], []
            for seed in seeds:
                torch.manual_seed(seed)
                model = TransformerLM(config)
                times.append(train(model, tasks_at, steps=steps, batch=batch, lr=lr))
                results.append(evaluate(model, task, sequences=eval_sequences))
            row = {"task": task_name, "attention": name, "chance": task.chance, "steps": steps,
                   "step_s": sum(times) / len(times), "keys_per_query": keys_per_query(config),
                   "train_flops": model.training_flops(steps, batch * seq_len), "heads": config.describe_heads(),
                   "seeds": [r["accuracy"] for r in results],
                   **{key: sum(r[key] for r in results) / len(results) for key in results[0]}}
            if first is None:
                first = row["accuracy"]
            row["vs_first"] = row["accuracy"] / first if first else None
            rows.append(row)
            echo(table([row]).splitlines()[-1])
    echo("")
    echo(table(rows))
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _per_probe(row: dict, key: str) -> str:
    """'58.0' for one probe; '58.0 (31.2+26.8)' for several (a key lies in one cluster: the shares add up)."""
    if key not in row:
        return "-"
    parts = [row[f"{key}_{t}"] for t in range(1, 100) if f"{key}_{t}" in row]
    total = _pct(row[key])
    return total if len(parts) <= 1 else f"{total} ({'+'.join(_pct(p) for p in parts)})"


HEADERS = ["task", "attention", "accuracy %", "seeds %", "vs first", "chance %", "steps", "s/step", "keys/query",
           "train TFLOP", "balance", "in cluster %", "in window %", "head options"]


def table(rows: list[dict]) -> str:
    return format_table(
        HEADERS,
        [[r["task"], r["attention"], _pct(r["accuracy"]), "/".join(_pct(a) for a in r["seeds"]),
          "-" if r["vs_first"] is None else f"{r['vs_first']:.2f}", _pct(r["chance"]), r["steps"],
          f"{r['step_s']:.3f}", f"{r['keys_per_query']:.1f}", f"{r['train_flops'] / 1e12:.2f}",
          f"{r['balance']:.2f}" if "balance" in r else "-", _per_probe(r, "in_cluster"), _per_probe(r, "in_window"),
          r["heads"]]
         for r in rows])
