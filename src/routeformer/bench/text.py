"""Text benchmark: validation bits per byte of models that differ only in their attention, trained on the same
data with the same parameters and the same wall-clock budget.

    routeformer bench text [--attention local local+routing full] [--seq-len 1024] [--minutes 4]

Each row is ``routeformer train`` (the shipped default configuration, its data set and schedule) with the row's
attention, the given context and a budget of ``--minutes`` of training, then scored on the whole validation split.
``train TFLOP`` is the estimated work of the steps it took (``TransformerLM.training_flops``: a routing warm-up
counted at its own cost and length).
The cosine schedule runs over ``--steps``: a row that reaches the time budget first stops where it is in the
schedule, so a faster mechanism takes more steps and decays further, as it would in any budgeted run
(``--set decay_steps=0`` lays the cosine over the time budget instead: each row reaches ``min_lr`` as its time runs
out). ``--device`` and ``--dtype`` are the rows' ``device`` and ``precision`` (autocast). The run directories stay
under ``--out`` for inspection.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..attention.routing.kind import RoutingOptions, default_routing_window
from ..lengths import sqrt_len
from ..model import TransformerLM, local_window
from .measure import executor_lines, format_table, notes
from .recall import attention_config


@dataclass(frozen=True)
class TextBench:
    """What ``bench text`` trains: every row at ``seq_len`` for at most ``steps`` steps (the cosine's length) and
    ``minutes``; the local heads' ``window`` (and rel_clip; None: the configuration's), routing's ``num_clusters``
    (None: round(√seq_len)) and ``routing_window`` (None: seq_len / k keys per query over the row's probes); on the
    built-in data set ``data`` (kept in ``data_dir``); run directories under ``out``; ``overrides``: --set items of
    the main job's configuration, for every row."""

    seq_len: int = 1024
    minutes: float = 4.0
    steps: int = 2000
    window: int | None = None
    num_clusters: int | None = None
    routing_window: int | None = None
    data: str = "stdlib"
    data_dir: str | None = None
    out: str = "runs/bench-text"
    overrides: tuple[str, ...] = ()


def run(attentions: list[str], bench: TextBench = TextBench(), echo: Callable[[str], None] = print) -> list[dict]:
    """Train and score one model per attention; print the table row by row, then whole; return the rows. Every row's
    configuration is checked before the first trains. ``echo``'s notes (``measure.Echo``): where the line naming the
    executor the models run on goes (the command line: stderr)."""
    from ..data import prepare_builtin
    from ..train import executor_line, load_run_config, train

    b, overrides = bench, list(bench.overrides)
    seq_len, steps = b.seq_len, b.steps
    prepare_builtin(b.data, b.data_dir, echo)
    base = load_run_config(None, overrides).model
    # the cosine runs over --steps whatever the configuration plans (the main job's decay_steps is its own), unless
    # the overrides set decay_steps (0: over the time budget, for a machine whose speed no one knows yet)
    settings = {"data": b.data, "data_dir": b.data_dir, "max_steps": steps, "max_minutes": b.minutes}
    if not _overridden(overrides, "train", "decay_steps"):
        settings["decay_steps"] = steps
    # nor its way to learning to copy (a curriculum planned for its 7,200 steps, and the token shift that goes with
    # it): the rows compare attention, on the model and data the study's tables were measured with
    if not _overridden(overrides, "train", "repeat_steps"):
        settings["repeat_steps"] = 0
    plain_model = [] if _overridden(overrides, "model", "token_shift") else ["token_shift='none'"]
    planned = []  # (name, the --set items, its run configuration, its run directory)
    for name in attentions:
        fields = attention_config(name, base.heads)
        spec = fields.pop("attention")
        sets = [*plain_model, f"seq_len={seq_len}", f"attention={spec!r}"]
        if b.window is not None:  # the local window, and rel_clip unless the overrides set it
            clip = not _overridden(overrides, "model", "rel_clip")
            sets += _settings(local_window(b.window, rel_clip=clip))
        # The shipped configuration pins routing's k, window and warm-up length for its own seq_len (unused by
        # other kinds): keep seq_len / k keys per query over the row's probes, and the warm-up's share of seq_len.
        k = b.num_clusters or sqrt_len(seq_len)
        routing = base.options.get("routing") or RoutingOptions()
        probes = _row_setting(fields, "probes", routing.probes)
        window_ = b.routing_window or default_routing_window(seq_len, k, probes)
        sets += [f"options.routing.num_clusters={k}", f"options.routing.window={window_}"]
        if routing.warmup_len is not None and _row_setting(fields, "warmup_len", None) is None:
            pieces = base.seq_len // routing.warmup_len
            if seq_len % pieces:
                raise ValueError(f"--seq-len {seq_len}: the configuration's routing warm-up cuts each sequence into "
                                 f"{pieces} pieces, which must divide it (or give the row "
                                 f"@options.routing.warmup_len=...)")
            sets.append(f"options.routing.warmup_len={seq_len // pieces}")
        # the row's own @field settings last: they override the bench's
        sets += _settings(fields)
        run_config = load_run_config(None, overrides + sets, settings)
        # one folder per (length, row): the README's runs at 256, 1024 and 2048 share --out
        folder = name.replace("/", "-").replace(":", "").replace(",", "-").replace("+", "-")
        run_dir = Path(b.out) / f"{seq_len}-{folder}"
        planned.append((name, sets, run_config, run_dir))
    say = notes(echo)
    if say is not None:
        for line in executor_lines({name: executor_line(run_config) for name, _, run_config, _ in planned}):
            say(line)
    rows: list[dict] = []
    for name, sets, run_config, run_dir in planned:
        echo(f"# {name}: routeformer train --set {' --set '.join(sets)} --max-steps {steps} "
             f"--max-minutes {b.minutes} --out {run_dir}")
        result = train(run_config, run_dir, echo=lambda *_: None)
        model = run_config.model
        t = run_config.train
        flops = TransformerLM(model).training_flops(result.step, t.batch_size * model.seq_len,
                                                    short_steps=t.short_steps, short_len=t.short_len)
        rows.append({"attention": name, "seq_len": model.seq_len, "steps": result.step, "minutes": result.minutes,
                     "train_flops": flops, "valid": result.valid, "unit": result.unit,
                     "heads": model.describe_heads()})
        echo(table(rows[-1:]).splitlines()[-1])
    echo("")
    echo(table(rows))
    return rows


def table(rows: list[dict]) -> str:
    return format_table(["attention", "seq_len", "steps", "minutes", "train TFLOP", "valid", "head options"],
                        [[r["attention"], r["seq_len"], r["steps"], f"{r['minutes']:.1f}",
                          f"{r['train_flops'] / 1e12:.2f}",
                          "n/a" if r["valid"] is None or math.isnan(r["valid"]) else f"{r['valid']:.3f} {r['unit']}",
                          r["heads"]]
                         for r in rows])


def _settings(fields: dict) -> list[str]:
    """TransformerConfig fields (an ``options`` table section by section) as --set items."""
    return ([f"{key}={_toml(value)}" for key, value in fields.items() if key != "options"]
            + [f"options.{section}.{key}={_toml(value)}" for section, table in fields.get("options", {}).items()
               for key, value in table.items()])


def _overridden(overrides: list[str], table: str, key: str) -> bool:
    """Whether one of the --set items sets the field ``key`` of ``table`` ('model' or 'train')."""
    return any(item.partition("=")[0].strip().removeprefix(f"{table}.") == key for item in overrides)


def _row_setting(fields: dict, name: str, default):
    """A routing setting a row gives (@options.routing.<name>=…), else ``default``."""
    return fields.get("options", {}).get("routing", {}).get(name, default)


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)
