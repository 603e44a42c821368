"""TransformerConfig: everything that defines a model, validated on construction and saved as config.json."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..attention.checks import positive_int

# Mechanisms a head can use. "strided" and "fixed" are the Sparse Transformer's merged heads (A1 ∪ A2); the
# "_a1" / "_a2" variants attend to one set only, which gives its split heads ("strided_a1:4,strided_a2:4") and,
# with one spec per layer, its interleaved layers (["strided_a1", "strided_a2"]).
MECHANISMS = ("full", "local", "routing", "strided", "strided_a1", "strided_a2", "fixed", "fixed_a1", "fixed_a2",
              "longformer")
POSITIONS = ("relative", "absolute", "factorized", "none")
ACTIVATIONS = ("sigmoid_gelu", "gelu")


def parse_attention(spec: str, heads: int, where: str = "attention") -> list[tuple[str, int]]:
    """'local:4,routing:4' -> [('local', 4), ('routing', 4)]; a single name means every head."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{where} must be a non-empty string such as 'local:4,routing:4', got {spec!r}")
    parts = [p.strip() for p in spec.split(",")]
    out: list[tuple[str, int]] = []
    for part in parts:
        name, _, count = part.partition(":")
        name = name.strip()
        if name not in MECHANISMS:
            raise ValueError(f"{where}: unknown mechanism {name!r} in {spec!r}; allowed: {', '.join(MECHANISMS)}")
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


@dataclass
class TransformerConfig:
    """A model, fully described. Defaults: a small byte-level half local, half routing model.

    Fields:
        vocab_size: tokens (256 for bytes).
        dim, depth, heads: model width, blocks, attention heads per block.
        head_dim: width of a head; default dim // heads (dim must then be divisible by heads).
        seq_len: the training context.
        attention: which mechanism each head uses: 'local:4,routing:4' (counts sum to heads) or one name for
            every head ('full', 'local', 'strided', ...), or a list of such specs, one per layer.
        window: local window (keys per query), also Longformer's.
        num_clusters, routing_window: routing heads' k and keys per query; defaults round(sqrt(seq_len)) and
            seq_len // num_clusters.
        shared_qk: routing heads use their queries as keys (the official text configurations).
        separate_routing: routing heads route queries by q and keys by k (needs shared_qk=False); see
            ``RoutingAttention``'s ``separate``.
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
        commitment, kmeans_decay: routing's commitment-loss weight β and k-means EMA decay.
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
    commitment: float = 1e-4
    kmeans_decay: float = 0.999

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "depth", "heads", "seq_len", "window", "block", "summary"):
            positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.dim % self.heads:
                raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads}), or set head_dim")
            self.head_dim = self.dim // self.heads
        positive_int("head_dim", self.head_dim)
        if self.attention is None:
            half = self.heads // 2
            self.attention = f"local:{self.heads - half},routing:{half}" if half else "local"
        specs = self.layer_specs()  # validates the spec(s)
        used = {name for spec in specs for name, _ in spec}
        if self.num_clusters is None:
            self.num_clusters = max(1, round(math.sqrt(self.seq_len)))
        positive_int("num_clusters", self.num_clusters)
        if self.routing_window is None:
            self.routing_window = max(1, self.seq_len // self.num_clusters)
        positive_int("routing_window", self.routing_window)
        if self.stride is None:
            self.stride = max(1, round(math.sqrt(self.seq_len)))
        positive_int("stride", self.stride)
        if self.rel_clip is None:
            self.rel_clip = self.window
        positive_int("rel_clip", self.rel_clip)
        if self.summary > self.block:
            raise ValueError(f"summary ({self.summary}) must be at most block ({self.block})")
        limits = {"local": ("window", self.window), "longformer": ("window", self.window),
                  "routing": ("routing_window", self.routing_window), "strided": ("stride", self.stride),
                  "strided_a1": ("stride", self.stride), "strided_a2": ("stride", self.stride),
                  "fixed": ("block", self.block), "fixed_a1": ("block", self.block), "fixed_a2": ("block", self.block)}
        for mech in sorted(used & set(limits)):
            name, value = limits[mech]
            if value > self.seq_len:
                raise ValueError(f"{name} ({value}) is larger than seq_len ({self.seq_len}), which {mech} heads "
                                 f"do not allow; use at most {self.seq_len}")
        if "routing" in used and self.num_clusters > self.seq_len:
            raise ValueError(f"num_clusters ({self.num_clusters}) is larger than seq_len ({self.seq_len})")
        lf = max((n for spec in specs for name, n in spec if name == "longformer"), default=0)
        if isinstance(self.dilation, (list, tuple)):
            self.dilation = [positive_int(f"dilation[{i}]", d) for i, d in enumerate(self.dilation)]
            if "longformer" in used and len(self.dilation) != lf:
                raise ValueError(f"dilation gives {len(self.dilation)} values but there are {lf} longformer heads")
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
        for name in ("shared_qk", "separate_routing", "checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.separate_routing and self.shared_qk:
            raise ValueError("separate_routing=True routes queries and keys apart, which needs shared_qk=False")

    def layer_specs(self) -> list[list[tuple[str, int]]]:
        """Per layer, the (mechanism, heads) groups."""
        if isinstance(self.attention, str):
            return [parse_attention(self.attention, self.heads)] * self.depth
        if isinstance(self.attention, (list, tuple)):
            if len(self.attention) != self.depth:
                raise ValueError(f"attention gives {len(self.attention)} layer specs but depth = {self.depth}")
            return [parse_attention(s, self.heads, f"attention[{i}]") for i, s in enumerate(self.attention)]
        raise ValueError(f"attention must be a spec string or a list of them (one per layer), got {self.attention!r}")

    def uses(self, mechanism: str) -> bool:
        """Whether some head of some layer uses ``mechanism``."""
        return any(name == mechanism for spec in self.layer_specs() for name, _ in spec)

    def keys_per_query(self, seq_len: int | None = None) -> dict[str, float]:
        """The work of one query of each mechanism, in keys scored, at context ``seq_len`` (default the config's):
        the mean keys it scores, plus the k centroids it is routed by for routing (twice both for separate routing,
        which runs a key event and a query event per position). ``TransformerLM.flops_per_token`` counts it."""
        n = seq_len or self.seq_len
        keys = {
            "full": (n + 1) / 2,
            "local": min(self.window, n),
            "routing": min(self.routing_window, n) + self.num_clusters,  # + routing each token to k centroids
            "strided": min(self.stride + 1, n) + n / (2 * self.stride), "strided_a1": min(self.stride + 1, n),
            "strided_a2": n / (2 * self.stride),
            "fixed": min(self.block, n) / 2 + n * self.summary / (2 * self.block), "fixed_a1": min(self.block, n) / 2,
            "fixed_a2": n * self.summary / (2 * self.block),
            "longformer": min(self.window, n) + len(self.global_tokens),
        }
        if self.separate_routing:  # 2N events (a key and a query per position), each routed and banded
            keys["routing"] *= 2
        return keys

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TransformerConfig:
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
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of config fields")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None

