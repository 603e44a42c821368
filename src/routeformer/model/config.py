"""TransformerConfig: everything that defines a model, validated on construction and saved as config.json."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from ..attention.checks import positive_int
from ..attention.executors import check_backend
from ..attention.kernels import check_kernel
from ..attention.kinds.base import HeadKind, Warmup
from ..attention.registry import KINDS, default_attention, get_kind

POSITIONS = ("relative", "absolute", "factorized", "none")
# What a saved config without the routing rule's fields was trained with: one probe, no bias, no warm-up.
def default_routing_window(seq_len: int, num_clusters: int, probes: int) -> int:
    """Keys per probed cluster so that a routing query scores about seq_len / k keys over its probes."""
    return max(1, seq_len // (num_clusters * probes))


LEGACY_ROUTING = {"routing_probes": 1, "routing_balance": 0.0, "routing_warmup": 0, "routing_gate": False}
ACTIVATIONS = ("sigmoid_gelu", "gelu")


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
        window: local window (keys per query), also Longformer's.
        num_clusters, routing_window: routing heads' k and keys per probed cluster; defaults round(sqrt(seq_len))
            and seq_len // (num_clusters · routing_probes), so that a query scores about seq_len / k keys.
        shared_qk: routing heads use their queries as keys (the official text configurations).
        separate_routing: routing heads route queries by q and keys by k (needs shared_qk=False); see
            ``RoutingAttention``'s ``separate``.
        routing_probes: the clusters each routing query probes (p; it scores up to p · routing_window keys).
            Default 2 (the paper's rule: 1, with routing_balance 0).
        routing_balance: the step of the bias that balances the routing clusters between optimiser steps (0: the
            paper's plain argmax). Default 0.01.
        routing_warmup: optimiser steps of dense causal attention before the routing heads route (0: none, the
            default: a warm-up is part of a training recipe, as a learning-rate warm-up is; routing heads learn
            long-range retrieval only after one, see the README's recall benchmark).
        routing_warmup_len: the sequence length the warm-up trains at (None: seq_len; it must divide seq_len): the
            trainers cut each batch into sequences that long while the warm-up lasts, the same tokens at a
            fraction of the dense attention's cost.
        routing_gate: weigh each probed cluster by the query's softmax over its centroid scores.
        stride: strided heads' l; default round(sqrt(seq_len)). Also the row width of factorized positions.
        block, summary: fixed heads' l and c.
        dilation, global_tokens: Longformer heads' dilation (int or one per Longformer head) and global positions.
        positions: 'relative' (Shaw et al., clipped at rel_clip, shared across heads), 'absolute' (learned),
            'factorized' (learned row and column embeddings of width `stride`, or row, column and channel of
            `image_shape`), 'none'.
        rel_clip: largest relative distance told apart; default `window`.
        image_shape: (rows, columns, channels) of image data, for factorized positions.
        dropout: at the end of each residual branch only.
        ff_mult: feed-forward width / dim. activation: 'sigmoid_gelu' (x·sigmoid(1.702x)) or 'gelu'.
        checkpointing: recompute each block in the backward pass.
        backend: how heads that run on an attention executor are computed: 'auto' (FlexAttention on CUDA, the
            tiled PyTorch executor elsewhere), 'tiles' or 'flex' (``routeformer.attention.executors``).
            Linear, Performer and the poly2 / elu kernels have one implementation of their own.
        commitment, kmeans_decay: routing's commitment-loss weight β and k-means EMA decay.
        kernel: the similarity full, local and linear heads normalise, 'exp' (softmax), 'poly2' or 'elu'
            (``routeformer.attention.kernels``); linear heads need 'poly2' or 'elu', other kinds take only 'exp',
            which the config checks.
        features: Performer heads' random features m; default round(head_dim · ln head_dim).
        redraw_every: Performer heads draw new random features every this many optimiser steps (0: never).
        lsh_buckets, lsh_rounds, lsh_window: LSH heads' buckets (even), hash rounds and keys per query per round;
            defaults round(sqrt(seq_len)) rounded up to even, 2, seq_len // lsh_buckets.
        options: settings of user-registered kinds, {kind name: {field: value}} (the built-in kinds read the
            fields above).

    The fields each kind reads are checked only when a head uses it (``HeadKind.options``).
    """

    vocab_size: int = 256
    dim: int = 256
    depth: int = 4
    heads: int = 8
    head_dim: int | None = None
    seq_len: int = 1024
    attention: str | list[str] | None = None
    window: int = 128
    num_clusters: int | None = None
    routing_window: int | None = None
    shared_qk: bool = True
    separate_routing: bool = False
    routing_probes: int = 2
    routing_balance: float = 0.01
    routing_warmup: int = 0
    routing_warmup_len: int | None = None
    routing_gate: bool = False
    stride: int | None = None
    block: int = 128
    summary: int = 8
    dilation: int | list[int] = 1
    global_tokens: list[int] = field(default_factory=list)
    positions: str = "relative"
    rel_clip: int | None = None
    image_shape: list[int] | None = None
    dropout: float = 0.0
    ff_mult: float = 4.0
    activation: str = "sigmoid_gelu"
    checkpointing: bool = False
    backend: str = "auto"
    commitment: float = 1e-4
    kmeans_decay: float = 0.999
    kernel: str = "exp"
    features: int | None = None
    redraw_every: int = 0
    lsh_buckets: int | None = None
    lsh_rounds: int = 2
    lsh_window: int | None = None
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "depth", "heads", "seq_len", "window", "block", "summary"):
            positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.dim % self.heads:
                raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads}), or set head_dim")
            self.head_dim = self.dim // self.heads
        positive_int("head_dim", self.head_dim)
        if self.attention is None:
            self.attention = default_attention(self.heads)
        self.layer_specs()  # validates the spec(s)
        if self.num_clusters is None:
            self.num_clusters = max(1, round(math.sqrt(self.seq_len)))
        positive_int("num_clusters", self.num_clusters)
        positive_int("routing_probes", self.routing_probes)
        if self.routing_window is None:
            self.routing_window = default_routing_window(self.seq_len, self.num_clusters, self.routing_probes)
        positive_int("routing_window", self.routing_window)
        if self.stride is None:
            self.stride = max(1, round(math.sqrt(self.seq_len)))
        positive_int("stride", self.stride)
        if self.rel_clip is None:
            self.rel_clip = self.window
        positive_int("rel_clip", self.rel_clip)
        if self.summary > self.block:
            raise ValueError(f"summary ({self.summary}) must be at most block ({self.block})")
        if isinstance(self.dilation, (list, tuple)):
            self.dilation = [positive_int(f"dilation[{i}]", d) for i, d in enumerate(self.dilation)]
        else:
            positive_int("dilation", self.dilation)
        self.global_tokens = [int(g) for g in self.global_tokens]
        bad = [g for g in self.global_tokens if not 0 <= g < self.seq_len]
        if bad:
            raise ValueError(f"global_tokens must lie in [0, seq_len={self.seq_len}), got {bad}")
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
        if not (isinstance(self.kmeans_decay, numbers.Real) and 0.0 <= self.kmeans_decay < 1.0):
            raise ValueError(f"kmeans_decay must be in [0, 1), got {self.kmeans_decay!r}")
        if not (isinstance(self.commitment, numbers.Real) and self.commitment >= 0):
            raise ValueError(f"commitment must be non-negative, got {self.commitment!r}")
        if isinstance(self.routing_balance, bool) or not (isinstance(self.routing_balance, numbers.Real)
                                                          and 0.0 <= self.routing_balance < math.inf):
            raise ValueError(f"routing_balance must be a non-negative number (0: no bias), got "
                             f"{self.routing_balance!r}")
        if isinstance(self.routing_warmup, bool) or not isinstance(self.routing_warmup, int) or self.routing_warmup < 0:
            raise ValueError(f"routing_warmup must be a non-negative integer (optimiser steps), got "
                             f"{self.routing_warmup!r}")
        if self.routing_warmup_len is not None:
            positive_int("routing_warmup_len", self.routing_warmup_len)
        for name in ("shared_qk", "separate_routing", "routing_gate", "checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.separate_routing and self.shared_qk:
            raise ValueError("separate_routing=True routes queries and keys apart, which needs shared_qk=False")
        if not isinstance(self.options, dict):
            raise ValueError(f"options must be a mapping of kind name to its settings, got {self.options!r}")
        for name, given in self.options.items():
            if name not in KINDS:
                raise ValueError(f"options: unknown kind {name!r}; registered: {', '.join(KINDS)}")
            kind = KINDS[name]
            if not kind.reads_config_options:
                raise ValueError(f"options[{name!r}]: {name} heads take their settings from the config's own "
                                 f"fields, not from options")
            if not isinstance(given, dict):
                raise ValueError(f"options[{name!r}] must be a mapping of field to value, got {given!r}")
        check_kernel("kernel", self.kernel)
        check_backend(self.backend)
        groups = self.head_groups()  # each kind validates the fields it reads
        on_executor = [g for layer in groups for g in layer if g.kind.runs_on_executor(g.options)]
        if self.backend != "auto" and not on_executor:
            raise ValueError(f"backend={self.backend!r} would change nothing: no head of this model runs on an "
                             f"attention executor (linear, Performer and the poly2 / elu kernels compute "
                             f"their own way); leave backend='auto'")
        for group in (g for layer in groups for g in layer):
            if self.kernel != "exp" and not group.kind.reads_kernel:
                users = ", ".join(k.name for k in KINDS.values() if k.reads_kernel)
                raise ValueError(f"kernel={self.kernel!r} applies to {users} heads; {group.kind.name} heads use the "
                                 f"exponential kernel only (kernel='exp')")
            if self.positions == "relative" and not group.kind.supports_relative(group.options):
                raise ValueError(f"positions='relative': {group.kind.name} heads do not support relative positions "
                                 f"({group.kind.describe_options(group.options)}); use positions='absolute' or "
                                 "'none'")

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
        """Per layer, its groups of heads with their kinds and validated options."""
        return [[HeadGroupSpec(kind, n, kind.resolve(self, n)) for kind, n in ((get_kind(name), n) for name, n in spec)]
                for spec in self.layer_specs()]

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
        found = [g.kind.warmup(g.options) for layer in self.head_groups() for g in layer if g.kind.warmup is not None]
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


    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TransformerConfig:
        if "routing_probes" not in data:  # written before routing had probes, a bias and a warm-up: the rule then
            data = {**LEGACY_ROUTING, **data}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys: {', '.join(sorted(known))}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TransformerConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of config fields")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None

