"""The configuration of an encoder-decoder run (``routeformer train --config translate``): a TOML file with the
tables

- ``[model]``: ``TransformerConfig`` fields both stacks share (vocab_size, dim, heads, positions, token_shift, …);
- ``[encoder]``, ``[decoder]``: each stack's own fields (depth, seq_len: the longest source / target + 1,
  attention, ``[encoder.options.<section>]``), over ``[model]``'s;
- ``[cross]``: ``attention``, the decoder's cross-attention spec (``routing:2,full:2``), and
  ``[cross.options.<kind>]`` (``attention/cross.py``);
- ``[train]``: ``TrainConfig``, where ``batch_size`` counts pairs (of similar lengths, ``data.pairs``).

``--set`` takes ``encoder.depth=3``, ``decoder.options.local.window=32``, ``model.dim=192`` (both stacks),
``cross.attention=full``, ``cross.options.routing.probes=2``, and the [train] fields, bare or as ``train.lr``.
The [train] settings of a byte stream that pairs have no use for (windows, the repeat curriculum, the length
warm-up, packing, the final sample's length, FSDP, torch.compile = true) are refused by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..model import TransformerConfig
from ..model.seq2seq import Seq2SeqConfig
from .config import FIELDS, TrainConfig, _table, check_option_path

TABLES = ("model", "encoder", "decoder", "cross", "train")
UNUSED = {"eval_overlap": 0.0, "repeat_steps": 0, "short_steps": 0, "short_len": 0, "pack": "none",
          "sample_tokens": TrainConfig.sample_tokens, "fsdp": False}  # [train] fields pairs do not use: defaults


@dataclass
class Seq2SeqRun:
    """An encoder-decoder run: the model (``Seq2SeqConfig``) and how to train it."""

    model: Seq2SeqConfig
    train: TrainConfig

    def __post_init__(self) -> None:
        for name, default in UNUSED.items():
            if getattr(self.train, name) != default:
                raise ValueError(f"[train] {name} = {getattr(self.train, name)!r}: an encoder-decoder run on pairs has "
                                 f"no use for it (it trains on whole pairs, with DDP); leave it out")
        if self.train.compile is True:
            raise ValueError("[train] compile = true: an encoder-decoder run's batches change length every step, "
                             "which torch.compile would recompile for; leave compile out (\"auto\" runs eagerly)")

    def to_toml(self) -> str:
        """The resolved configuration (a run directory's config.toml): every stack's fields in full."""
        m = self.model
        options = {k: None if o is None else asdict(o) for k, o in m.cross_options.items()}
        return (f"# resolved configuration of this run (an encoder-decoder model)\n\n"
                f"[encoder]\n{_table(asdict(m.encoder))}\n[decoder]\n{_table(asdict(m.decoder))}\n"
                f"[cross]\n{_table({'attention': m.cross, 'options': options})}\n[train]\n{_table(asdict(self.train))}")


def is_seq2seq(raw: dict) -> bool:
    """Whether a configuration file's tables are an encoder-decoder run's."""
    return any(name in raw for name in ("encoder", "decoder", "cross"))


def seq2seq_run(raw: dict, where: str, overrides: list[str] | None = None, extra: dict | None = None,
                *, saved: bool = False) -> Seq2SeqRun:
    """The run of a file's ``raw`` tables (``where``: how to name the file in errors), with ``--set`` overrides
    and the command line's ``extra`` [train] values; ``saved``: a run directory's config.toml."""
    unknown = sorted(set(raw) - set(TABLES))
    if unknown:
        raise ValueError(f"{where}: unknown top-level keys {unknown}; an encoder-decoder run has the tables "
                         f"{', '.join(TABLES)}")
    tables = {name: dict(raw.get(name, {})) for name in TABLES}
    for item in overrides or []:
        _override(tables, item)
    for key, value in (extra or {}).items():
        if value is not None:
            tables["train"][key] = value
    for name in ("model", "encoder", "decoder"):
        bad = sorted(set(tables[name]) - FIELDS["model"])
        if bad:
            raise ValueError(f"{where}: unknown [{name}] keys {bad}; valid keys: {', '.join(sorted(FIELDS['model']))}")
    bad = sorted(set(tables["cross"]) - {"attention", "options"})
    if bad:
        raise ValueError(f"{where}: unknown [cross] keys {bad}; valid keys: attention, options")
    bad = sorted(set(tables["train"]) - FIELDS["train"])
    if bad:
        raise ValueError(f"{where}: unknown [train] keys {bad}; valid keys: {', '.join(sorted(FIELDS['train']))}")
    stacks = {}
    for name in ("encoder", "decoder"):
        merged = {**tables["model"], **tables[name]}
        merged["options"] = {**tables["model"].get("options", {}), **tables[name].get("options", {})}
        try:
            stacks[name] = TransformerConfig.from_dict(merged, saved=saved)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: [{name}]: {err}") from None
    try:
        model = Seq2SeqConfig(stacks["encoder"], stacks["decoder"], tables["cross"].get("attention", "full"),
                              {k: v for k, v in tables["cross"].get("options", {}).items() if v is not None})
        return Seq2SeqRun(model, TrainConfig(**tables["train"]))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def _override(tables: dict[str, dict], item: str) -> None:
    """One ``--set KEY=VALUE`` into the tables (see the module)."""
    from .config import parse_value

    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--set {item!r}: expected KEY=VALUE")
    value = parse_value(text)
    table, _, rest = key.partition(".")
    if table not in TABLES or not rest:  # a bare name: a [train] field, else one both stacks share
        table, rest = ("train" if key in FIELDS["train"] else "model"), key
    if table == "cross":
        if rest == "attention":
            tables["cross"]["attention"] = value
            return
        parts = rest.split(".")
        if len(parts) != 3 or parts[0] != "options":
            raise ValueError(f"--set {key}: [cross] takes attention and options.<kind>.<field>")
        tables["cross"].setdefault("options", {}).setdefault(parts[1], {})[parts[2]] = value
        return
    if rest.startswith("options.") and table != "train":
        section, name = check_option_path(rest, f"--set {key}")
        tables[table].setdefault("options", {}).setdefault(section, {})[name] = value
        return
    known = FIELDS["train" if table == "train" else "model"]
    if rest not in known:
        raise ValueError(f"--set {key}: unknown key; [{table}] keys: {', '.join(sorted(known))}")
    tables[table][rest] = value


__all__ = ["Seq2SeqRun", "is_seq2seq", "seq2seq_run"]
assert {f.name for f in fields(TrainConfig)} >= set(UNUSED)
