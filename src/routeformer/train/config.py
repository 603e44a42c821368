"""Run configuration: a TOML file with a [model] table (TransformerConfig) and a [train] table (TrainConfig).

``--set key=value`` overrides either table: ``key`` is a field name (unique across both tables),
``model.key`` / ``train.key``, or a kind's option ``options.<section>.<field>`` (``options.routing.window``; the
[model.options.<section>] tables of the file); ``value`` is read as TOML (``3e-4``, ``true``, ``"local:4,routing:4"``,
``[1, 2]``), and a bare word is read as a string. Unknown keys are an error that lists the valid ones. The old flat
names of kinds' settings (``window``, ``routing_window``, ...: ``model.legacy.MOVED``) are an error that names their
``options.<section>.<field>``, in a configuration file and in ``--set``; only a run directory's saved config.toml is
read with them (``read_run_config`` migrates it).
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..model import TransformerConfig
from ..model.config import refuse_old_spelling, sections

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
SCHEDULES = ("cosine", "inverse_sqrt", "constant")
PRECISIONS = ("auto", "float32", "bfloat16", "float16")


PACKS = ("none", "boundaries", "documents")  # TrainConfig.pack: documents ignored, their boundaries kept, or
# whole documents packed first-fit

@dataclass
class TrainConfig:
    """How to train: data, optimisation, budget, evaluation, logging.

    batch_size is the number of sequences per optimiser step over all processes; each process runs
    batch_size / (processes · grad_accum) sequences per forward. The learning rate warms up linearly over
    warmup_steps, then decays (cosine to min_lr at decay_steps, or as 1/sqrt(step)). decay_steps = 0 means
    max_steps, or the time budget when that stops the run first (``schedule.TimeShare``); set it to plan the decay
    in steps alone (a longer schedule than this invocation runs, to stop early and resume later). max_minutes
    bounds the wall time of each invocation (a resumed run gets its own budget). compile: ``torch.compile`` the
    model training calls forward on (true, false, or "auto": on a CPU, in one process, after the run's first steps,
    when the rest would take ``train.parallel.AUTO_COMPILE_MINUTES`` or longer eagerly, so that compiling pays).
    eval_overlap: the final score on the whole validation split lays its windows of seq_len so that each overlaps
    the one before by this fraction of seq_len and scores only the rest: windows every floor((1 - eval_overlap) ·
    seq_len) tokens, every prediction from eval_overlap · seq_len tokens of context or more (0: non-overlapping
    windows, as ``routeformer evaluate`` without ``--stride``); the periodic estimate stays non-overlapping.
    batch_tokens (an encoder-decoder run's): batches of pairs of similar lengths holding up to this many padded
    positions (pairs times the longer side), at most batch_size pairs (``data.pairs.PairBatches``); 0: batch_size
    pairs a batch.
    repeat_steps, repeat_share: a curriculum of repeated text (``data.repeats.RepeatCurriculum``): in steps
    1..repeat_steps each training row is, with probability repeat_share, its own first seq_len/8 to seq_len/2
    tokens over and over, so that the model learns early to copy what it has read; 0 steps: none.
    short_steps, short_len: a length warm-up (short rows first): in steps 1..short_steps every row of seq_len
    tokens is cut into rows of short_len (the same tokens, seq_len / short_len times as many rows), and a
    curriculum's repeats are drawn within those rows (so that its copies lie within what the short rows show);
    0 steps: none. short_len must divide seq_len (checked against the model).
    pack: how training rows and evaluation windows treat the data set's documents (a file of stdlib, sympy or a
    text folder; ``Dataset.starts``): "none", rows and windows read across them as one text; "boundaries", rows and
    windows as before, each carrying its documents' ids (``TransformerLM.forward(documents=)``): nothing is
    predicted from another document, and evaluation scores each from its own start; "documents", whole documents
    (cut into rows of seq_len + 1 tokens where longer) packed first-fit into padded rows (``data.packing``), the
    loss over the predictions within a document, evaluation as with "boundaries".
    """

    data: str = "stdlib"
    data_dir: str | None = None
    batch_size: int = 16
    batch_tokens: int = 0
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.98
    clip: float = 1.0
    max_steps: int = 1000
    decay_steps: int = 0
    max_minutes: float | None = None
    eval_every: int = 250
    eval_tokens: int = 65536
    eval_overlap: float = 0.0
    repeat_steps: int = 0
    repeat_share: float = 0.5
    short_steps: int = 0
    short_len: int = 0
    pack: str = "none"
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"
    compile: bool | str = "auto"
    fsdp: bool = False
    tensorboard: bool = False
    wandb: str | None = None
    sample_tokens: int = 300

    def train_len(self, step: int, seq_len: int) -> int:
        """The row length of optimiser step ``step`` (1-based) for a model of ``seq_len``: short_len during the
        length warm-up, else seq_len."""
        return self.short_len if step <= self.short_steps else seq_len

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "warmup_steps", "max_steps", "decay_steps", "eval_every",
                     "eval_tokens", "log_every", "repeat_steps", "short_steps", "short_len", "batch_tokens"):
            value = getattr(self, name)
            may_be_zero = name in ("warmup_steps", "decay_steps", "repeat_steps", "short_steps", "short_len",
                                   "batch_tokens")
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < (0 if may_be_zero else 1):
                raise ValueError(f"{name} must be a {'non-negative' if may_be_zero else 'positive'} "
                                 f"integer, got {value!r}")
        if self.pack not in PACKS:
            raise ValueError(f"pack must be one of {', '.join(PACKS)}, got {self.pack!r}")
        if (self.short_steps == 0) != (self.short_len == 0):
            raise ValueError(f"a length warm-up needs both short_steps and short_len (or neither), got "
                             f"short_steps={self.short_steps} and short_len={self.short_len}")
        overlap = self.eval_overlap
        if isinstance(overlap, bool) or not isinstance(overlap, numbers.Real) or not 0 <= overlap < 1:
            raise ValueError(f"eval_overlap must be a fraction in [0, 1), got {overlap!r}")
        share = self.repeat_share
        if isinstance(share, bool) or not isinstance(share, numbers.Real) or not 0 < share <= 1:
            raise ValueError(f"repeat_share must be a fraction in (0, 1], got {share!r}")
        for name in ("lr", "min_lr", "weight_decay", "clip", "beta1", "beta2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr!r}) must not exceed lr ({self.lr!r})")
        if isinstance(self.sample_tokens, bool) or not isinstance(self.sample_tokens, numbers.Integral) or \
                self.sample_tokens < 0:
            raise ValueError(f"sample_tokens must be a non-negative integer, got {self.sample_tokens!r}")
        for name in ("data_dir", "wandb"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu", "cuda") or
                                                    self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1!r}, {self.beta2!r}")
        if self.max_minutes is not None and (isinstance(self.max_minutes, bool) or not isinstance(
                self.max_minutes, numbers.Real) or self.max_minutes <= 0):
            raise ValueError(f"max_minutes must be a positive number, got {self.max_minutes!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.data, str) or not self.data:
            raise ValueError(f"data must be a data set name, got {self.data!r}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by grad_accum ({self.grad_accum})")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise ValueError(f'compile must be true, false or "auto", got {self.compile!r}')
        for name in ("fsdp", "tensorboard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")


@dataclass
class RunConfig:
    model: TransformerConfig
    train: TrainConfig

    def __post_init__(self) -> None:
        check_stride(overlap_stride(self.model.seq_len, self.train.eval_overlap), self.model,
                     f"eval_overlap {self.train.eval_overlap!r}'s stride")
        if self.train.batch_tokens:
            raise ValueError(f"batch_tokens = {self.train.batch_tokens}: an encoder-decoder run's batches of pairs; "
                             f"a language model's batch is batch_size rows of seq_len tokens")

    def to_toml(self) -> str:
        return (f"# resolved configuration of this run\n\n[model]\n{_table(asdict(self.model))}\n"
                f"[train]\n{_table(asdict(self.train))}")


FIELDS = {"model": {f.name for f in fields(TransformerConfig)},
          "train": {f.name for f in fields(TrainConfig)}}
assert not FIELDS["model"] & FIELDS["train"], "a bare --set key must name one field"


def overlap_stride(seq_len: int, overlap: float) -> int | None:
    """The stride of windows of ``seq_len`` that overlap by the fraction ``overlap`` (``TrainConfig.eval_overlap``):
    floor((1 - overlap) · seq_len), at least 1, so that every scored prediction has overlap · seq_len tokens of
    context or more (seq_len - 1 at most); None for non-overlapping windows."""
    stride = max(1, math.floor((1 - overlap) * seq_len))
    return None if stride >= seq_len else stride


def check_stride(stride: int | None, model: TransformerConfig, name: str) -> None:
    """A stride of scored windows (``name``: how the user spelled it) that this model can take: at most seq_len,
    and none for a model whose positions are an image's (every window must be one whole image)."""
    if stride is None or stride == model.seq_len:
        return
    if stride > model.seq_len:
        raise ValueError(f"{name} {stride} is larger than seq_len ({model.seq_len})")
    if model.positions == "factorized" and model.image_shape:
        raise ValueError(f"{name} {stride}: this model's positions are an image's rows, columns and channels, so "
                         f"every window must be one whole image (no stride)")


def resolve_config_path(name: str | Path) -> Path:
    """A path, or the name of a shipped configuration (``default``, ``enwik8``, …)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    shipped = CONFIG_DIR / f"{name}.toml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    raise ValueError(f"--config {name}: no such file, and not a shipped configuration ({names})")


def read_config_file(path: str | Path | None) -> tuple[Path, dict]:
    """The path (a file, or a shipped name; default: default.toml) and its TOML tables; an error naming it."""
    path = resolve_config_path(path or "default")
    try:
        return path, tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML ({err})") from None


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None,
                    extra: dict | None = None) -> RunConfig:
    """Read a TOML configuration (default: the shipped default.toml), apply ``--set`` overrides and ``extra``.
    (``train.load_run_config`` also reads an encoder-decoder run's file.)"""
    path, raw = read_config_file(path)
    tables = {"model": dict(raw.pop("model", {})), "train": dict(raw.pop("train", {}))}
    if raw:
        raise ValueError(f"{path}: unknown top-level keys {sorted(raw)}; use the [model] and [train] tables")
    refuse_old_spelling(tables["model"], f"{path}: [model] ", "[model.options.{section}] {key}")
    for table, values in tables.items():
        unknown = sorted(set(values) - FIELDS[table])
        if unknown:
            valid = ", ".join(sorted(FIELDS[table]))
            raise ValueError(f"{path}: unknown [{table}] keys {unknown}; valid keys: {valid}")
    for item in overrides or []:
        table, key, value = parse_override(item)
        set_field(tables[table], key, value)
    for key, value in (extra or {}).items():
        if value is not None:
            tables["train"][key] = value
    try:
        return RunConfig(TransformerConfig(**tables["model"]), TrainConfig(**tables["train"]))
    except TypeError as err:
        raise ValueError(f"{path}: {err}") from None


def parse_override(item: str) -> tuple[str, str, object]:
    """'key=value' -> (table, key, value); a kind's option keeps its path: ('model', 'options.routing.window', 16)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--set {item!r}: expected KEY=VALUE")
    path = key.removeprefix("model.")
    if path.startswith("options."):
        check_option_path(path, f"--set {key}")
        table, name = "model", path
    else:
        table, _, name = key.rpartition(".")
        if table in ("", "model"):
            refuse_old_spelling({name: text}, f"--set {key}: ", f"--set options.{{section}}.{{key}}={text.strip()}")
        if table:
            if table not in FIELDS or name not in FIELDS[table]:
                raise ValueError(f"--set {key}: unknown key; valid keys: {_valid_keys()}")
        else:
            tables = [t for t, names in FIELDS.items() if name in names]
            if not tables:
                raise ValueError(f"--set {key}: unknown key; valid keys: {_valid_keys()}")
            table = tables[0]
    return table, name, parse_value(text)


def parse_value(text: str) -> object:
    """A ``--set`` value: read as TOML (``3e-4``, ``true``, ``"local:4"``, ``[1, 2]``), a bare word as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def check_option_path(path: str, where: str) -> tuple[str, str]:
    """'options.routing.window' -> ('routing', 'window'), checked against the registered kinds' options."""
    parts = path.split(".")
    known = sections()
    if len(parts) != 3 or parts[1] not in known:
        raise ValueError(f"{where}: a kind's option is options.<section>.<field>, sections: {', '.join(known)}")
    names = known[parts[1]].option_fields
    if parts[2] not in names:
        raise ValueError(f"{where}: options.{parts[1]} has no field {parts[2]!r}; fields: {', '.join(names) or 'none'}")
    return parts[1], parts[2]


def set_field(model_or_train: dict, key: str, value: object) -> None:
    """Set ``key`` (a field or 'options.<section>.<field>') in a table."""
    if key.startswith("options."):
        section, name = check_option_path(key, key)
        options = model_or_train.setdefault("options", {})
        options.setdefault(section, {})[name] = value
        return
    model_or_train[key] = value


def _valid_keys() -> str:
    return ", ".join(sorted(FIELDS["model"] | FIELDS["train"]))


def _table(values: dict) -> str:
    return "".join(f"{key} = {_toml_value(value)}\n" for key, value in values.items() if value is not None)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, keys quoted; TOML has no null: a None is left out (its default)
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items()
                               if v is not None) + "}"
    raise ValueError(f"cannot write {value!r} to TOML")
