"""Recall benchmark: does an attention mechanism reach, by content, what lies beyond every local window?

    routeformer bench recall [--tasks mqar passkey two_hop] [--attention full local local+routing]

Trains the same small model once per (task, attention) for a fixed number of steps on batches generated on the
fly (``data/recall.py``: what an answer needs lies further back than depth × (window - 1), the reach of local
attention, so a local-only model stays at chance), then scores held-out batches. Columns: accuracy on the scored
positions, the task's chance level, steps, seconds per step, the keys a query scores (mean over heads of
``TransformerConfig.keys_per_query``, the attention cost), and for routing heads what they reached: cluster balance
(keys in the largest cluster / mean), how often the key the answer needs is in the query's cluster and how often it
is within the query's routing window (the first hop's key for ``two_hop``; mean over routing heads and layers).
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
from ..train.config import TrainConfig
from ..train.schedule import learning_rate
from .measure import format_table

EVAL_SEED = 10**6  # held-out batches use seeds from here; training batches use seeds 0, 1, ...


# How routing heads route (config fields), chosen by a row's suffix: 'local+routing/separate'.
ROUTING = {
    "shared": {"shared_qk": True, "separate_routing": False},  # the paper's text models: keys are the queries
    "joint": {"shared_qk": False, "separate_routing": False},  # one cluster per position, from n(q) + n(k)
    "separate": {"shared_qk": False, "separate_routing": True},  # a query cluster and a key cluster per position
}


def attention_config(name: str, heads: int) -> dict:
    """Config fields of a row: 'full', 'local', 'local+routing' (half and half) or any attention spec, optionally
    followed by '/shared', '/joint' or '/separate' (how routing heads route; default: the config's default)."""
    spec, _, routing = name.partition("/")
    half = heads // 2
    fields = {"attention": {"local+routing": f"local:{heads - half},routing:{half}"}.get(spec, spec)}
    if routing:
        if routing not in ROUTING:
            raise ValueError(f"unknown routing variant {routing!r} in {name!r}; choose from {', '.join(ROUTING)}")
        fields.update(ROUTING[routing])
    return fields


def keys_per_query(config: TransformerConfig) -> float:
    """Mean over heads of the keys one query scores (``TransformerConfig.keys_per_query``, the attention cost)."""
    keys = config.keys_per_query()
    heads = [(keys[name], h) for layer in config.layer_specs() for name, h in layer]
    return sum(c * h for c, h in heads) / sum(h for _, h in heads)


def train(model: TransformerLM, task: RecallTask, *, steps: int, batch: int, lr: float,
          warmup: int = 50) -> float:
    """Train on batches of seeds 0 … steps - 1; returns seconds per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = TrainConfig(lr=lr, min_lr=0.0, warmup_steps=min(warmup, steps), max_steps=steps)  # warm-up, cosine
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate(s + 1, schedule) / lr)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        b = task.make(batch, step)
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
    reached (NaN when none does)."""
    model.eval()
    seen: list[tuple[HeadGroup, torch.Tensor, torch.Tensor]] = []
    hooks = [g.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0], args[1])))
             for g in model.head_groups() if type(g).reach is not HeadGroup.reach]
    correct = total = 0
    reached: dict[str, list[torch.Tensor]] = {"balance": [], "in_cluster": [], "in_window": []}
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
    def mean(xs: list[torch.Tensor]) -> float:
        return float(torch.stack(xs).mean()) if xs else float("nan")

    return {"accuracy": correct / total, **{key: mean(values) for key, values in reached.items()}}


def run(tasks: list[str], attentions: list[str], *, seq_len: int = 128, gap: int = 32, depth: int = 2,
        dim: int = 64, heads: int = 4, window: int = 8, num_clusters: int | None = None,
        routing_window: int | None = None, steps: int = 800, batch: int = 32,
        lr: float = 1e-3, eval_sequences: int = 512, seed: int = 0, extra: dict | None = None,
        echo: Callable[[str], None] = print) -> list[dict]:
    """Train and score one model per (task, attention); print the table row by row, then whole; return the rows.
    ``extra``: further TransformerConfig fields for every model (``kmeans_decay``, ``positions``, ...)."""
    for name in tasks:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; choose from {', '.join(sorted(TASKS))}")
    if gap < depth * (window - 1):
        raise ValueError(f"gap ({gap}) must be at least depth × (window - 1) = {depth * (window - 1)}, the reach of "
                         "local attention, or a local-only model can see the answer and the benchmark would not test "
                         "long-range reach")
    echo(f"# recall benchmark: N={seq_len}, gap>{gap}, depth={depth}, dim={dim}, heads={heads}, window={window}, "
         f"steps={steps}, batch={batch}, lr={lr}, seed={seed}, threads={torch.get_num_threads()}")
    rows: list[dict] = []
    for task_name in tasks:
        task = TASKS[task_name](seq_len=seq_len, min_gap=gap)
        for name in attentions:
            config = TransformerConfig(vocab_size=task.vocab_size, dim=dim, depth=depth, heads=heads,
                                       seq_len=seq_len, window=window, num_clusters=num_clusters,
                                       routing_window=routing_window,
                                       **{**attention_config(name, heads), **(extra or {})})
            torch.manual_seed(seed)
            model = TransformerLM(config)
            s_per_step = train(model, task, steps=steps, batch=batch, lr=lr)
            row = {"task": task_name, "attention": name, "chance": task.chance, "steps": steps,
                   "step_s": s_per_step, "keys_per_query": keys_per_query(config),
                   "heads": config.describe_heads(),
                   **evaluate(model, task, sequences=eval_sequences)}
            rows.append(row)
            echo(table([row]).splitlines()[-1])
    echo("")
    echo(table(rows))
    return rows


def table(rows: list[dict]) -> str:
    def pct(x: float) -> str:
        return "-" if math.isnan(x) else f"{100 * x:.1f}"

    return format_table(
        ["task", "attention", "accuracy %", "chance %", "steps", "s/step", "keys/query", "balance",
         "in cluster %", "in window %", "head options"],
        [[r["task"], r["attention"], pct(r["accuracy"]), pct(r["chance"]), r["steps"], f"{r['step_s']:.3f}",
          f"{r['keys_per_query']:.1f}", "-" if math.isnan(r["balance"]) else f"{r['balance']:.2f}",
          pct(r["in_cluster"]), pct(r["in_window"]), r["heads"]]
         for r in rows])

