"""TransformerConfig: everything that defines a model, validated on construction and saved as config.json."""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from ..attention.kinds.base import HeadKind, Warmup
from ..attention.registry import KINDS, default_attention, get_kind
from ..checks import positive_int
from ..executors import check_backend
from ..lengths import sqrt_len
from .legacy import migrate_saved, refuse_old_spelling

POSITIONS = ("relative", "absolute", "factorized", "none")
ACTIVATIONS = ("sigmoid_gelu", "gelu")
TOKEN_SHIFTS = ("none", "half", "learned")
# The kinds whose heads attend to a band of the last `window` positions: one number, the local window, sets each
# one's window and the relative positions' clip that fits it (``local_window``). legacy.MOVED["window"] is another
# thing: a record, frozen, of what the old flat `window` meant when saved files were written.
LOCAL_BANDS = ("local", "longformer")


def local_window(window: int, *, rel_clip: bool = True) -> dict[str, Any]:
    """The TransformerConfig fields the local window sets, for the constructor (``bench.measure.merge_fields``
    merges them section by section): {'options': {'local': {'window': w}, 'longformer': {'window': w}}, 'rel_clip':
    w}; ``rel_clip=False`` leaves the clip out (a configuration that sets it itself)."""
    fields: dict[str, Any] = {"options": {kind: {"window": window} for kind in LOCAL_BANDS}}
    if rel_clip:
        fields["rel_clip"] = window
    return fields


def sections() -> dict[str, HeadKind]:
    """The sections of ``TransformerConfig.options``: each registered kind's ``options_key``, with a kind that reads
    it."""
    out: dict[str, HeadKind] = {}
    for kind in KINDS.values():
        out.setdefault(kind.options_key, kind)
    return out


def parse_attention(spec: str, heads: int, where: str = "attention") -> list[tuple[str, int]]:
    """'local:4,routing:4' -> [('local', 4), ('routing', 4)]; a single name means every head. Names are the
    registered head kinds (``attention.registry.KINDS``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{where} must be a non-empty string such as 'local:4,routing:4', got {spec!r}")
    parts = [p.strip() for p in spec.split(",")]
    out: list[tuple[str, int]] = []
    for part in parts:
        name, _, count = part.partition(":")
        name = name.strip()
        if name not in KINDS:
            raise ValueError(f"{where}: unknown mechanism {name!r} in {spec!r}; allowed: {', '.join(KINDS)}")
        if count:
            try:
                n = int(count)
            except ValueError:
                raise ValueError(f"{where}: head count {count!r} of {name!r} is not an integer") from None
            if n < 1:
                raise ValueError(f"{where}: head count of {name!r} must be positive, got {n}")
        elif len(parts) == 1:
            n = heads
        else:
            raise ValueError(f"{where}: give a head count for each mechanism when mixing them, e.g. "
                             f"'local:{heads // 2},routing:{heads - heads // 2}', got {spec!r}")
        if name in dict(out):
            raise ValueError(f"{where}: mechanism {name!r} appears twice in {spec!r}")
        out.append((name, n))
    total = sum(n for _, n in out)
    if total != heads:
        raise ValueError(f"{where}: head counts in {spec!r} sum to {total}, but heads = {heads}")
    return out


class HeadGroupSpec(NamedTuple):
    """One group of heads of a layer: its kind, how many heads, and the kind's typed options."""

    kind: HeadKind
    heads: int
    options: Any


@dataclass
class TransformerConfig:
    """A model, fully described. Defaults: a small byte-level half local, half routing model.

    Fields:
        vocab_size: tokens (256 for bytes).
        dim, depth, heads: model width, blocks, attention heads per block.
        head_dim: width of a head; default dim // heads (dim must then be divisible by heads).
        seq_len: the training context.
        attention: which kind of head each head is: 'local:4,routing:4' (counts sum to heads) or one name for
            every head ('full', 'local', 'strided', ...), or a list of such specs, one per layer. Names are the
            registered kinds (``routeformer.attention.KINDS``; ``register_kind`` adds one).
        positions: 'relative' (Shaw et al., clipped at rel_clip, shared across heads), 'absolute' (learned),
            'factorized' (learned row and column embeddings of width `grid_width`, or row, column and channel of
            `image_shape`), 'none'.
        rel_clip: largest relative distance told apart.
        grid_width: the row width of factorized positions for text; default round(sqrt(seq_len)).
        image_shape: (rows, columns, channels) of image data, for factorized positions.
        dropout: at the end of each residual branch only.
        ff_mult: feed-forward width / dim. activation: 'sigmoid_gelu' (x·sigmoid(1.702x)) or 'gelu'.
        checkpointing: recompute each block in the backward pass.
        token_shift: what each attention layer's input takes from the position before (zeros at the first): 'none';
            'half' (its channels dim // 2 onwards are the position before's: lucidrains' ``shift_tokens``);
            'learned' (x + mu * (x_before - x), mu one learned weight per channel, starting at 0: RWKV's token
            shift). A key that carries the byte before it lets one head match "what followed this byte last time"
            (copying) without a second layer building that first. On the main job neither paid alone; 'learned'
            with a curriculum of repeated text (``TrainConfig.repeat_steps``) did, and the main job uses both
            (docs/training.md).
        backend: how heads that run on an attention executor are computed: 'auto' (FlexAttention on CUDA, the
            fused C++ kernels on the CPU), 'fused', 'tiles' or 'flex' (``routeformer.executors``).
            Linear, Performer and the poly2 / elu kernels have one implementation of their own.
        options: each kind's settings, {section: {field: value}} (or the kind's options dataclass), one section per
            mechanism: 'local' (window, kernel), 'routing' (num_clusters, window, probes, balance, warmup, ...),
            'strided' (stride), 'fixed' (block, summary), 'longformer', 'lsh', 'linear', 'performer', 'full'
            (kernel), and any registered kind's own (``HeadKind.option_type``, ``HeadKind.section``). A used kind's
            section is filled with its defaults and checked against the model (errors name
            ``options.<section>.<field>``); after construction ``options[section]`` is the typed dataclass. Sections
            of kinds the model does not use are checked field by field and kept (a configuration file may serve
            several ``attention`` mixes).

    The settings that used to be fields of their own (``window``, ``num_clusters``, ``routing_window``, ``stride``,
    ``kernel``, ``lsh_rounds``, ...: ``MOVED``) are an error here that names their section; only saved files written
    in that spelling are read with them (``from_dict(..., saved=True)``, ``load``: ``migrate_saved``).
    """

    vocab_size: int = 256
    dim: int = 256
    depth: int = 4
    heads: int = 8
    head_dim: int | None = None
    seq_len: int = 1024
    attention: str | list[str] | None = None
    positions: str = "relative"
    rel_clip: int = 128
    grid_width: int | None = None
    image_shape: list[int] | None = None
    dropout: float = 0.0
    ff_mult: float = 4.0
    activation: str = "sigmoid_gelu"
    checkpointing: bool = False
    token_shift: str = "none"
    backend: str = "auto"
    options: dict = field(default_factory=dict)

    def __new__(cls, *args: Any, **kwargs: Any) -> TransformerConfig:
        """Refuse the old flat settings (``MOVED``) by name, with their new spelling, before the dataclass's
        constructor would call them unexpected keywords."""
        refuse_old_spelling(kwargs, "TransformerConfig: ")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "depth", "heads", "seq_len", "rel_clip"):
            positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.dim % self.heads:
                raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads}), or set head_dim")
            self.head_dim = self.dim // self.heads
        positive_int("head_dim", self.head_dim)
        if self.attention is None:
            self.attention = default_attention(self.heads)
        self.layer_specs()  # validates the spec(s)
        if self.grid_width is None:
            self.grid_width = sqrt_len(self.seq_len)
        positive_int("grid_width", self.grid_width)
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.image_shape is not None:
            self.image_shape = [positive_int(f"image_shape[{i}]", x) for i, x in enumerate(self.image_shape)]
            if len(self.image_shape) != 3:
                raise ValueError(f"image_shape must be (rows, columns, channels), got {self.image_shape}")
        if not (isinstance(self.dropout, numbers.Real) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not (isinstance(self.ff_mult, numbers.Real) and self.ff_mult > 0):
            raise ValueError(f"ff_mult must be positive, got {self.ff_mult!r}")
        if not isinstance(self.checkpointing, bool):
            raise ValueError(f"checkpointing must be true or false, got {self.checkpointing!r}")
        if self.token_shift not in TOKEN_SHIFTS:
            raise ValueError(f"token_shift must be one of {', '.join(TOKEN_SHIFTS)}, got {self.token_shift!r}")
        self.options = self._read_options()
        check_backend(self.backend)
        groups = [g for layer in self.head_groups() for g in layer]
        if self.backend != "auto" and not any(g.kind.runs_on_executor(g.options) for g in groups):
            raise ValueError(f"backend={self.backend!r} would change nothing: no head of this model runs on an "
                             f"attention executor (poly2 linear heads and the poly2 / elu kernel heads "
                             f"compute their own way); leave backend='auto'")
        for group in groups:
            if self.positions == "relative" and not group.kind.supports_relative(group.options):
                raise ValueError(f"positions='relative': {group.kind.name} heads do not support relative positions "
                                 f"({group.kind.describe_options(group.options)}); use positions='absolute' or "
                                 "'none'")

    def _read_options(self) -> dict[str, Any]:
        """``options`` as typed dataclasses per section: the sections of the kinds in use completed with the model's
        defaults and checked against it, the others checked field by field."""
        if not isinstance(self.options, dict):
            raise ValueError(f"options must be a table of sections ({', '.join(sections())}), got {self.options!r}")
        known = sections()
        unknown = sorted(set(self.options) - set(known))
        if unknown:
            raise ValueError(f"options: unknown section(s) {unknown}; the registered kinds read "
                             f"{', '.join(known)}")
        used = {get_kind(name).options_key for spec in self.layer_specs() for name, _ in spec}
        out = {}
        for key, kind in known.items():
            if key in used:
                value = kind.resolve(self.options.get(key), self)
            elif key in self.options:
                value = kind.read_options(self.options[key])
            else:
                continue
            if value is not None:
                out[key] = value
        return out

    def layer_specs(self) -> list[list[tuple[str, int]]]:
        """Per layer, the (mechanism, heads) groups."""
        if isinstance(self.attention, str):
            return [parse_attention(self.attention, self.heads)] * self.depth
        if isinstance(self.attention, (list, tuple)):
            if len(self.attention) != self.depth:
                raise ValueError(f"attention gives {len(self.attention)} layer specs but depth = {self.depth}")
            return [parse_attention(s, self.heads, f"attention[{i}]") for i, s in enumerate(self.attention)]
        raise ValueError(f"attention must be a spec string or a list of them (one per layer), got {self.attention!r}")

    def head_groups(self) -> list[list[HeadGroupSpec]]:
        """Per layer, its groups of heads with their kinds and options."""
        return [[HeadGroupSpec(kind, n, self.options.get(kind.options_key))
                 for kind, n in ((get_kind(name), n) for name, n in spec)] for spec in self.layer_specs()]

    def uses(self, mechanism: str) -> bool:
        """Whether some head of some layer uses ``mechanism``."""
        return any(name == mechanism for spec in self.layer_specs() for name, _ in spec)

    def keys_per_query(self, seq_len: int | None = None, step: int | None = None) -> dict[str, float]:
        """The work of one query of each kind the model uses, in keys scored, at context ``seq_len`` (default the
        config's) and optimiser step ``step`` (None: after any warm-up): ``HeadKind.cost`` (routing adds the k
        centroids it is routed by; during its dense warm-up it scores every earlier key).
        ``TransformerLM.flops_per_token`` counts it."""
        n = seq_len or self.seq_len
        return {g.kind.name: g.kind.cost(g.options, n, step) for layer in self.head_groups() for g in layer}

    def warmups(self) -> list[Warmup]:
        """The warm-ups of the kinds the model uses (``HeadKind.warmup``), those that last a step or more."""
        found = [w for layer in self.head_groups() for g in layer for w in g.kind.phases(g.options)]
        return [w for w in found if w.steps > 0]

    def cost_changes(self) -> list[int]:
        """The optimiser steps (counted from 0) at which some kind's warm-up ends: where the cost per step changes."""
        return sorted({w.steps for w in self.warmups()})

    def train_len(self, step: int) -> int:
        """The sequence length to train at optimiser step ``step`` (counted from 0): the shortest length a warm-up
        still running asks for, else seq_len. Batches are cut into sequences that long (the same tokens)."""
        lengths = [w.length for w in self.warmups() if step < w.steps and w.length is not None]
        return min(lengths, default=self.seq_len)

    def describe_heads(self) -> str:
        """The options of each kind the model uses: 'local: window=128; routing: k=16, w=16'."""
        seen = {g.kind.name: g.kind.describe_options(g.options) for layer in self.head_groups() for g in layer}
        return "; ".join(f"{name}: {text}" for name, text in seen.items())

    def describe_executor(self, device: Any, dtype: Any = None) -> str:
        """The banner line of a command that runs this model on ``device`` (inputs of ``dtype``, when given): the
        executor its heads run on and why (``executors.describe_backend`` of ``backend``), or that none of them runs
        on one (then no kernel is built)."""
        from ..executors import describe_backend

        groups = [g for layer in self.head_groups() for g in layer]
        if not any(g.kind.runs_on_executor(g.options) for g in groups):
            kinds = ", ".join(dict.fromkeys(g.kind.name for g in groups))
            return f"attention: no executor (the {kinds} heads compute their own way)"
        return describe_backend(self.backend, device, dtype)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, saved: bool = False) -> TransformerConfig:
        """A config from its fields (a configuration file's [model] table, a saved config.json). ``saved``: the
        fields of a saved file (config.json, a run's config.toml), which may be in the old flat spelling
        (``MOVED``): it is migrated (``migrate_saved``). Otherwise an old flat name is an error naming its new
        spelling."""
        if saved:
            data = migrate_saved(data)
        else:
            refuse_old_spelling(data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys: {', '.join(sorted(known))}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TransformerConfig:
        data = read_json_object(path)
        try:
            return cls.from_dict(data, saved=True)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None


def read_json_object(path: str | Path) -> dict:
    """A saved config's JSON object (config.json); a ValueError names the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of config fields")
    return data
