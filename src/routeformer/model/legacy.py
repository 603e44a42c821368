"""The old flat spelling of the kinds' settings (``window``, ``routing_window``, ``lsh_rounds``, ...), before they
moved into ``TransformerConfig.options``: read only from saved run files (``migrate_saved``: config.json, a run's
config.toml); everywhere else an error that names the new spelling (``refuse_old_spelling``, ``old_spelling_error``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import fields
from typing import Any, NamedTuple

from ..attention.registry import KINDS, default_attention


class Moved(NamedTuple):
    """Where a setting that used to be a field of TransformerConfig lives now."""

    targets: tuple[tuple[str, str], ...]  # (section, field) of the kinds that read it
    model_field: str | None = None  # a model field whose default it also was (rel_clip, grid_width)


MOVED: dict[str, Moved] = {
    "window": Moved((("local", "window"), ("longformer", "window")), "rel_clip"),
    "num_clusters": Moved((("routing", "num_clusters"),)),
    "routing_window": Moved((("routing", "window"),)),
    "shared_qk": Moved((("routing", "shared_qk"),)),
    "separate_routing": Moved((("routing", "separate"),)),
    "routing_probes": Moved((("routing", "probes"),)),
    "routing_balance": Moved((("routing", "balance"),)),
    "routing_warmup": Moved((("routing", "warmup"),)),
    "routing_warmup_len": Moved((("routing", "warmup_len"),)),
    "routing_gate": Moved((("routing", "gate"),)),
    "commitment": Moved((("routing", "commitment"),)),
    "kmeans_decay": Moved((("routing", "decay"),)),
    "stride": Moved((("strided", "stride"),), "grid_width"),
    "block": Moved((("fixed", "block"),)),
    "summary": Moved((("fixed", "summary"),)),
    "dilation": Moved((("longformer", "dilation"),)),
    "global_tokens": Moved((("longformer", "global_tokens"),)),
    "kernel": Moved((("full", "kernel"), ("local", "kernel"), ("linear", "kernel"))),
    "features": Moved((("performer", "features"),)),
    "redraw_every": Moved((("performer", "redraw_every"),)),
    "lsh_buckets": Moved((("lsh", "buckets"),)),
    "lsh_rounds": Moved((("lsh", "rounds"),)),
    "lsh_window": Moved((("lsh", "window"),)),
}
# A saved config.json written before routing had probes, a bias and a warm-up was trained with the paper's rule.
LEGACY_ROUTING = {"routing_probes": 1, "routing_balance": 0.0, "routing_warmup": 0, "routing_gate": False}


def new_spelling(name: str) -> str:
    """'routing_window' -> 'options.routing.window' (or several, for a setting several kinds read)."""
    return " / ".join(f"options.{section}.{key}" for section, key in MOVED[name].targets)


def old_spelling_error(name: str, where: str = "", form: str = "options.{section}.{key}") -> ValueError:
    """The error for an old flat name (``MOVED``) given where only the sectioned spelling is read (the constructor,
    a configuration file, ``--set``): it names the new spelling (each target written as ``form``, e.g.
    ``"--set options.{section}.{key}=64"``), and the model field the old one also set."""
    spelling = " / ".join(form.format(section=section, key=key) for section, key in MOVED[name].targets)
    spelling = "that" if spelling == new_spelling(name) else spelling
    also = MOVED[name].model_field
    extra = (f" (it also set {also} when {also} was not given: set {also} too to keep that model)"
             if also is not None else "")
    return ValueError(f"{where}{name} is the old spelling of {new_spelling(name)}; write {spelling}{extra}. The "
                      f"flat names are read only from saved run files (config.json, a run's config.toml)")


def refuse_old_spelling(data: dict, where: str = "", form: str = "options.{section}.{key}") -> None:
    """Raise ``old_spelling_error`` for the first old flat name (``MOVED``) among the keys of ``data``."""
    for name in data:
        if name in MOVED:
            raise old_spelling_error(name, where, form)


def _plain(options: Any) -> dict:
    """A section as a mutable mapping (it may be given as the kind's dataclass)."""
    if dataclasses.is_dataclass(options):
        return {f.name: getattr(options, f.name) for f in fields(options) if f.init}
    return dict(options) if isinstance(options, dict) else options


def migrate_saved(data: dict) -> dict:
    """The fields of a saved config.json (or a run's config.toml) with the old flat settings (``MOVED``) moved into
    the ``options`` sections of the kinds the model uses, and into rel_clip / grid_width when not given: each head
    reads the value it read when the file was written. As then, a setting no kind of the model reads changes
    nothing. A file without ``routing_probes`` predates routing's probes, bias and warm-up: the paper's rule
    (``LEGACY_ROUTING``). A setting given both ways with different values is an error."""
    flat = {name: data[name] for name in MOVED if name in data}
    if not flat:
        return data
    data = {k: v for k, v in data.items() if k not in MOVED}
    if "routing_probes" not in flat and "num_clusters" in flat:
        flat = {**LEGACY_ROUTING, **flat}
    attention = data.get("attention")
    if attention is None:
        attention = default_attention(data.get("heads", 8))
    specs = [attention] if isinstance(attention, str) else attention if isinstance(attention, (list, tuple)) else []
    names = {part.partition(":")[0].strip() for spec in specs if isinstance(spec, str) for part in spec.split(",")}
    used = {KINDS[name].options_key for name in names if name in KINDS}  # the config reports unknown names
    options = {key: _plain(value) for key, value in copy.deepcopy(data.get("options") or {}).items()}
    for name, value in flat.items():
        moved = MOVED[name]
        for section, key in moved.targets:
            table = options.setdefault(section, {}) if section in used else None
            if not isinstance(table, dict):
                continue  # not used, or malformed (the config reports it)
            if key in table and table[key] != value:
                raise ValueError(f"{name} = {value!r} and options.{section}.{key} = {table[key]!r} both given; "
                                 f"{name} is the old spelling of {new_spelling(name)}: give one")
            table[key] = value
        if moved.model_field is not None and moved.model_field not in data:
            data[moved.model_field] = value
    if options:
        data["options"] = options
    return data
