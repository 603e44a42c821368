"""What an encoder-decoder model's routing heads read (``routeformer analyze RUN_DIR routing`` on a translation run).

For every routing group of the encoder (self-attention over the source) and of the decoder's cross-attention (over
the encoder's output), over pairs of a split run one at a time (no padding):

- ``keys``: the keys a query reads, on average, beside ``available``, the keys there are;
- ``recall``: the share of the head's dense attention (the softmax of its own q·k over every key; over every other
  key for heads that never read a query's own key while it has others, as routing's rule) that lies on the keys it
  reads. 1 means routing left out nothing its head would have weighed; ``keys / available`` is what a choice blind
  to content would keep;
- ``beyond`` (encoder groups): the share of the group's own attention at a distance of at least the local heads'
  window, what no local head of the layer reaches.

Dense, O(N²) per head and pair: analysis runs at the model's lengths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention.routing.cross import RoutedCrossHeads, routing_cross_mask
from ..data.pairs import Pair, pair_batch
from ..model.seq2seq import Seq2SeqLM
from .heads import HeadCall, _wrapper


@dataclass(frozen=True)
class GroupReading:
    """One routing group's averages over the queries of the pairs analysed (see the module)."""

    stack: str  # 'encoder' or 'cross'
    layer: int
    heads: range  # the group's heads among the layer's (self-attention's or the cross heads')
    keys: float
    available: float
    recall: float
    beyond: float | None  # encoder groups only


@dataclass
class _Sums:
    queries: int = 0
    keys: float = 0.0
    available: float = 0.0
    recall: float = 0.0
    beyond: float = 0.0

    def add(self, allowed: Tensor, dense: Tensor, beyond: Tensor | None) -> None:
        """allowed (1, h, Nq, Nk) bool, dense (1, h, Nq, Nk) the head's softmax over every key, beyond (1, h, Nq)."""
        h, nq, nk = allowed.shape[1:]
        self.queries += h * nq
        self.keys += float(allowed.sum())
        self.available += h * nq * nk
        self.recall += float((dense * allowed).sum())
        if beyond is not None:
            self.beyond += float(beyond.sum())


@contextlib.contextmanager
def _captured(model: Seq2SeqLM) -> Iterator[list[tuple]]:
    """Within the block, every encoder routing group's (layer, first head, HeadCall) and every decoder layer's cross
    inputs (layer, x, memory) of each forward are appended to the list yielded; the model's code is untouched."""
    seen: list[tuple] = []
    patched = []

    def keep(call: HeadCall, own):
        seen.append(("encoder", call.layer, call.first_head, call))
        return own()

    def wrap_cross(cross, layer):
        own = type(cross).forward

        def forward(x, memory, memory_padding=None, documents=None):
            seen.append(("cross", layer, x, memory))
            return own(cross, x, memory, memory_padding, documents)
        return forward

    try:
        for layer, block in enumerate(model.encoder):
            first = 0
            for group in block.attention.groups:
                if getattr(group, "num_clusters", None) is not None:
                    group.forward = _wrapper(group, layer, "routing", first, keep)
                    patched.append(group)
                first += group.heads
        for layer, block in enumerate(model.decoder):
            block.cross.forward = wrap_cross(block.cross, layer)
            patched.append(block.cross)
        yield seen
    finally:
        for module in patched:
            del module.forward


@torch.no_grad()
def routed_reading(model: Seq2SeqLM, pairs: Sequence[Pair], local_window: int | None = None) -> list[GroupReading]:
    """The routing groups' readings (see the module) over ``pairs``, each run alone (sources and targets cut to the
    model's lengths); ``local_window``: the distance ``beyond`` counts from (None: no ``beyond``). Encoder groups
    first, then the cross groups, each in layer order."""
    if not pairs:
        raise ValueError("routed_reading needs at least one pair")
    enc, dec = model.config.encoder, model.config.decoder
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums: dict[tuple[str, int, int], _Sums] = {}
    sizes: dict[tuple[str, int, int], int] = {}
    try:
        for source, target in pairs:
            batch = pair_batch([(source[:enc.seq_len], target[:dec.seq_len - 1])]).to(device)
            with _captured(model) as seen:
                model(batch.source, batch.target_in)
            for record in seen:
                if record[0] == "encoder":
                    _, layer, first, call = record
                    n = call.q.shape[2]
                    dense = torch.softmax(_without_own_key(call.scores.double(), call.allowed), -1)
                    far = None
                    if local_window is not None:
                        idx = torch.arange(n, device=call.q.device)
                        reach = (idx[:, None] - idx[None, :]).abs() >= local_window
                        far = (call.weights.double() * reach).sum(-1)
                    key = ("encoder", layer, first)
                    sums.setdefault(key, _Sums()).add(call.allowed, dense, far)
                    sizes[key] = call.group.heads
                else:
                    _, layer, x, memory = record
                    _cross_readings(model.decoder[layer].cross, layer, x, memory, sums, sizes)
    finally:
        model.train(was_training)
    return [GroupReading(stack, layer, range(first, first + sizes[(stack, layer, first)]), s.keys / s.queries,
                         s.available / s.queries, s.recall / s.queries,
                         s.beyond / s.queries if stack == "encoder" and local_window is not None else None)
            for (stack, layer, first), s in sorted(sums.items(), key=lambda kv: (kv[0][0] != "encoder", kv[0][1:]))]


def _without_own_key(scores: Tensor, allowed: Tensor) -> Tensor:
    """The scores (1, h, N, N) with each query's own key left out where the heads never read it while they read
    another (routing's rule): their dense attention is then over the other keys, which is all they could read."""
    own = torch.eye(scores.shape[-1], dtype=torch.bool, device=scores.device)
    others = allowed.sum(-1, keepdim=True) > 1
    if bool((allowed & own & others).any()):
        return scores
    return scores.masked_fill(own & others, float("-inf"))


def _cross_readings(cross, layer: int, x: Tensor, memory: Tensor, sums: dict, sizes: dict) -> None:
    """Add one decoder layer's routing cross groups to ``sums``: their routes under their own centroids."""
    first = 0
    for group, q, k in zip(cross.groups, cross._heads(cross.query, x), cross._heads(cross.key, memory), strict=True):
        if isinstance(group, RoutedCrossHeads):
            allowed = routing_cross_mask(group.routes(q, k), group.window)
            dense = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5, -1)
            key = ("cross", layer, first)
            sums.setdefault(key, _Sums()).add(allowed, dense, None)
            sizes[key] = group.heads
        first += group.heads


def format_reading(rows: list[GroupReading], label: str) -> str:
    """The readings as a text table, one row a group."""
    lines = [f"what the routing heads read: {label}",
             "stack    layer  heads  keys read  keys there  share read  recall  beyond local window",
             "-------  -----  -----  ---------  ----------  ----------  ------  -------------------"]
    for r in rows:
        heads = f"{r.heads.start}-{r.heads.stop - 1}" if len(r.heads) > 1 else str(r.heads.start)
        beyond = "" if r.beyond is None else f"{r.beyond:.3f}"
        lines.append(f"{r.stack:<7}  {r.layer:>5}  {heads:>5}  {r.keys:>9.1f}  {r.available:>10.1f}  "
                     f"{r.keys / r.available:>10.3f}  {r.recall:>6.3f}  {beyond:>19}")
    lines.append("recall: the share of each head's dense attention (its own softmax over every key) on the keys it "
                 "reads; share read: what a choice blind to content would keep")
    return "\n".join(lines)


__all__ = ["GroupReading", "format_reading", "routed_reading"]
