"""What the routing heads of a trained model use on held-out text (``routeformer analyze RUN_DIR routing``).

- ``routing_use``: over windows of the split, the share of each routing head's attention mass on keys at a distance
  of at least the model's local window (what no local head of the model reaches in one layer), the mass by
  distance (powers of two from the local window), and the most-attended routed pairs beyond the local window,
  with whether the ``context`` tokens ending at the query and at the key are the same (a repeated name, a
  repeated line: content-based retrieval of a copy).
- ``loss_by_recurrence``: where a routing model's per-token loss beats a baseline's (a local model on the same
  data), by the distance to the previous occurrence, inside the window, of the ``context`` tokens ending at the
  position (the bytes the model has just read): a distance beyond the local window is where a copy from far back
  can help.

Dense, O(N²) per head, at the model's seq_len (``HeadCall.weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model import TransformerLM
from .divergence import LN2
from .heads import capture


@dataclass(frozen=True)
class RoutedPair:
    """A query and the key it attends to in one routing head: ``weight``, the window's index among the windows
    analysed (``batch``, ``row``), positions ``query`` >= ``key``, and whether their contexts match."""

    weight: float
    layer: int
    head: int
    batch: int
    row: int
    query: int
    key: int
    same_context: bool


@dataclass
class RoutingUse:
    """``routing_use``'s result. ``beyond``: per (layer, head), the mean over queries of the attention mass at
    distance >= ``local_window``; ``mass``: per (layer, head), the mean mass per query in each distance bin
    [edges[b], edges[b + 1]); ``far_beyond``: per (layer, head), the mean mass at distance >= ``local_window`` over
    only the queries whose ``context`` tokens last occurred at that distance or more (``recurrence_distances``),
    ``far_queries`` of them (nan when there are none); ``top``: the most-attended pairs beyond the local window,
    heaviest first."""

    local_window: int
    context: int
    edges: list[int]
    beyond: dict[tuple[int, int], float] = field(default_factory=dict)
    far_beyond: dict[tuple[int, int], float] = field(default_factory=dict)
    far_queries: int = 0
    mass: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    top: list[RoutedPair] = field(default_factory=list)

    @property
    def matching(self) -> float:
        """The share of the top pairs whose contexts match (nan when there are none)."""
        return sum(p.same_context for p in self.top) / len(self.top) if self.top else float("nan")


def distance_edges(local_window: int, seq_len: int) -> list[int]:
    """Bin edges of distances: 0, the local window, then doubling, up to seq_len (the last bin ends there)."""
    edges, edge = [0, local_window], 2 * local_window
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    return edges + [seq_len] if edges[-1] < seq_len else edges


def same_context(row: Tensor, a: int, b: int, context: int) -> bool:
    """Whether the ``context`` tokens ending at positions a and b of ``row`` (N,) are equal (False when either
    starts before the row)."""
    if min(a, b) + 1 < context:
        return False
    return bool(torch.equal(row[a + 1 - context:a + 1], row[b + 1 - context:b + 1]))


@torch.no_grad()
def routing_use(model: TransformerLM, batches: list[Tensor], local_window: int, *, top: int = 100,
                context: int = 8) -> RoutingUse:
    """Where the routing heads (the groups that route: ``HeadGroup.clusters`` not None) put their attention on
    ``batches`` of (b, N) token windows; see ``RoutingUse``. O(N²) per head and window."""
    n = batches[0].shape[1]
    use = RoutingUse(local_window, context, distance_edges(local_window, n))
    sums: dict[tuple[int, int], Tensor] = {}
    far_sums: dict[tuple[int, int], float] = {}
    queries = far_queries = 0
    idx = torch.arange(n)
    distance = idx[:, None] - idx[None, :]  # (N, N): i - j
    bins = torch.bucketize(distance.clamp_min(0), torch.tensor(use.edges[1:-1]), right=True)  # (N, N) bin index
    candidates: list[RoutedPair] = []
    for b, tokens in enumerate(batches):
        queries += tokens.shape[0] * n
        # (B, N): the queries whose context last occurred beyond the local window
        recurs_far = torch.stack([recurrence_distances(row, context) >= local_window for row in tokens.cpu()])
        far_queries += int(recurs_far.sum())
        for call in capture(model, tokens):
            if call.group.num_clusters is None:  # not a group that routes
                continue
            w = call.weights.double().cpu()  # (B, h, N, N)
            per_bin = torch.zeros(*w.shape[:2], len(use.edges) - 1, dtype=torch.float64)
            per_bin.index_add_(2, bins.flatten(), w.flatten(2))  # (B, h, bins): summed over the queries
            far = w * (distance >= local_window)  # the routed pairs no local head reaches
            far_mass = far.sum(-1)  # (B, h, N): each query's mass beyond the local window
            for i, h in enumerate(call.heads):
                key = (call.layer, h)
                sums[key] = sums.get(key, 0) + per_bin[:, i].sum(0)
                far_sums[key] = far_sums.get(key, 0.0) + float(far_mass[:, i][recurs_far].sum())
            weights, flat = far.flatten(1).topk(min(top, far[0].numel()), dim=-1)  # per window row
            for row in range(w.shape[0]):
                for value, f in zip(weights[row].tolist(), flat[row].tolist(), strict=True):
                    if value <= 0:
                        break
                    i, rest = divmod(f, n * n)
                    q, k = divmod(rest, n)
                    candidates.append(RoutedPair(value, call.layer, call.heads[i], b, row, q, k,
                                                 same_context(tokens[row], q, k, context)))
        candidates = sorted(candidates, key=lambda p: -p.weight)[:top]
    for key, total in sorted(sums.items()):
        use.mass[key] = (total / queries).tolist()
        use.beyond[key] = float(total[1:].sum() / queries)
        use.far_beyond[key] = far_sums[key] / far_queries if far_queries else float("nan")
    use.far_queries = far_queries
    use.top = candidates
    return use


def recurrence_distances(row: Tensor, context: int) -> Tensor:
    """(N,) long: for each position t of ``row`` (N,), t - s for the last s < t whose ``context`` tokens ending at
    s equal those ending at t; 0 where there is none (or t + 1 < context). O(N) with a dictionary."""
    seen: dict[tuple[int, ...], int] = {}
    ids = row.tolist()
    out = [0] * len(ids)
    for t in range(context - 1, len(ids)):
        gram = tuple(ids[t + 1 - context:t + 1])
        if gram in seen:
            out[t] = t - seen[gram]
        seen[gram] = t
    return torch.tensor(out, dtype=torch.long)


@dataclass(frozen=True)
class RecurrenceRow:
    """Positions whose context last occurred ``low`` <= distance < ``high`` back (low = high = 0: never in the
    window): how many, and the two models' mean loss (bits per token) there."""

    low: int
    high: int
    positions: int
    loss: float
    baseline: float
    better: float  # the share of positions where the model's loss is below the baseline's

    @property
    def label(self) -> str:
        return "not in the window" if self.high == 0 else f"{self.low}-{self.high - 1}"


@torch.no_grad()
def per_token_bits(model: TransformerLM, windows: Tensor) -> Tensor:
    """(b, N): the loss in bits of predicting token t + 1 of each (b, N + 1) window from the tokens up to t."""
    model.eval()
    logits = model(windows[:, :-1].to(next(model.parameters()).device)).float().cpu()
    return F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none") / LN2


@torch.no_grad()
def loss_by_recurrence(model: TransformerLM, baseline: TransformerLM, windows: list[Tensor], edges: list[int], *,
                       context: int = 8) -> list[RecurrenceRow]:
    """Per-token losses of ``model`` and ``baseline`` on (b, N + 1) ``windows``, by the distance to the previous
    occurrence of the ``context`` tokens ending at the position (``recurrence_distances``), binned by ``edges``
    (from 0: the first row is the positions with no earlier occurrence)."""
    dists, ours, theirs = [], [], []
    for batch in windows:
        ours.append(per_token_bits(model, batch).flatten())
        theirs.append(per_token_bits(baseline, batch).flatten())
        dists.append(torch.cat([recurrence_distances(row[:-1], context) for row in batch]))
    d, a, b = torch.cat(dists), torch.cat(ours), torch.cat(theirs)
    rows = []
    for low, high in [(0, 0)] + [(max(lo, 1), hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]:
        sel = d == 0 if high == 0 else (d >= low) & (d < high)
        count = int(sel.sum())
        rows.append(RecurrenceRow(low, high, count, float(a[sel].mean()) if count else float("nan"),
                                  float(b[sel].mean()) if count else float("nan"),
                                  float((a[sel] < b[sel]).double().mean()) if count else float("nan")))
    return rows


def format_use(use: RoutingUse, show: Callable[[RoutedPair, int], str]) -> str:
    """The tables of ``routing_use``: mass beyond the local window and by distance per head, then the top pairs
    with their contexts (``show(pair, position)`` -> the text up to that position)."""
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(use.edges[:-1], use.edges[1:], strict=True)]
    lines = ["| layer | head | beyond the local window % | beyond it on far-recurring queries % | "
             + " | ".join(f"mass at {x} %" for x in labels) + " |",
             "|---:|---:|---:|---:|" + "---:|" * len(labels)]
    for (layer, head), beyond in use.beyond.items():
        lines.append(f"| {layer} | {head} | {100 * beyond:.1f} | {100 * use.far_beyond[(layer, head)]:.1f} | "
                     + " | ".join(f"{100 * m:.1f}" for m in use.mass[(layer, head)]) + " |")
    lines.append(f"Far-recurring queries: {use.far_queries}, those whose last {use.context} tokens last occurred "
                 f"{use.local_window} or more back in the window (where a copy must come from beyond the local window)")
    lines.append("")
    lines.append(f"The {len(use.top)} most-attended routed pairs at distance >= {use.local_window}: "
                 f"{100 * use.matching:.0f}% have the same {use.context} tokens ending at the query and at the key")
    lines.append("| weight | layer | head | distance | same context | key's context | query's context |")
    lines.append("|---:|---:|---:|---:|---|---|---|")
    for p in use.top:
        lines.append(f"| {p.weight:.3f} | {p.layer} | {p.head} | {p.query - p.key} | "
                     f"{'yes' if p.same_context else 'no'} | `{show(p, p.key)}` | `{show(p, p.query)}` |")
    return "\n".join(lines)


def format_recurrence(rows: list[RecurrenceRow], context: int, unit: str) -> str:
    lines = [f"| previous occurrence of the last {context} tokens | positions | share % | routing model "
             f"({unit}) | baseline ({unit}) | difference | routing better % |", "|---|---:|---:|---:|---:|---:|---:|"]
    total = sum(r.positions for r in rows) or 1
    for r in rows:
        numbers = (f"{r.loss:.3f} | {r.baseline:.3f} | {r.loss - r.baseline:+.3f} | {100 * r.better:.1f}"
                   if r.positions else "- | - | - | -")
        lines.append(f"| {r.label} | {r.positions} | {100 * r.positions / total:.1f} | {numbers} |")
    return "\n".join(lines)
