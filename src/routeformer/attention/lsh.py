"""Reformer-style LSH attention (Kitaev et al. 2020), causal without a leak and exact over several hash rounds.

Shared QK, as in Reformer: the keys are the queries normalised to unit length, k_j = q_j / |q_j|. Each of
``rounds`` hash rounds puts every position in one of ``buckets`` buckets by angular LSH, bucket = argmax([xR; -xR])
for a fixed random rotation R (D, buckets/2) per head and round.

What a query sees (``lsh_mask``): per round r, the sequence is sorted by (bucket, position) and query i sees the
entries of its own bucket at most ``window - 1`` places before it in that order (causal: the last ``window``
positions j <= i of its bucket, i itself included), or less than ``window`` places away on either side
(non-causal): the sorted-window rule of routing (``routing/sorted_window.py``) with the hash buckets as clusters.
Unlike Reformer's fixed chunks of the sorted sequence, what i sees depends only on positions <= i (later tokens
would shift chunk boundaries), and nothing wraps around. The query attends to the UNION of its rounds' windows,
each key counted once; its own key only when no other key is visible in any round (its output is then v_i);
padded keys never.

Exact once-counting: each round is attended on its own on the executor (a band over the round's sorted order,
within the bucket), and a pair that an earlier round's window already holds is left out of the later rounds' tiles,
so the rounds' key sets are disjoint; their softmaxes are then merged by their log-sum-exps (``merge_partials``),
which over disjoint sets is exactly the softmax over the union. (Weighting every round's copy by -log(c_ij), c_ij
the rounds that hold the pair, is exact too, with the executor's ``bias``; leaving pairs to their first round
needs a boolean tile mask instead of a float term and none at all in the first round: about 10 % faster at 16k.)
Reformer's -log(number of rounds with the same bucket) is an approximation of this. An executor with its own
rounds (the fused one, ``Executor.rounds_run``) runs every round, the merge, the unit keys and the own key in one
operator and keeps no round's probabilities; the others run one band per round and ``merge_partials``.

Cost per head: O(rounds · N · window · D) for the attention, O(rounds² · N · window) for the earlier rounds' pairs,
O(rounds · N · D · buckets/2) for hashing, O(rounds · N log N) for sorting; memory O(rounds · N · window) for the
scores kept for the backward on the tiles executor (no N×N tensor), O(N · (D + rounds)) on the fused one.

This module is the mechanism's one home: its functional form, its mask (what it means, for the tests), its head kind
and options, registered in ``registry.py``.

Heads. LSH heads (Reformer, Kitaev et al. 2020): shared QK, angular LSH with fixed random rotations, and per hash
round the last `window` positions of the query's bucket; the union over `lsh_rounds` rounds, each key once
(``attention/lsh.py``).

Decoding keeps, per head, round and bucket, a ring of the last `window` keys, values and positions (routing's
``RoutingCache`` with the rounds folded into the heads). A new token is hashed, written to its bucket's ring in
every round, and attends to the union of those rings, deduplicated: O(rounds · window · D + rounds · D · buckets/2)
per head, whatever its position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_options, positive_int
from ..executors import Backend, get_executor, merge_partials, saw_key
from ..executors.inputs import Inputs, check_inputs, refuse_cross
from ..executors.pieces import SortedWindow
from ..executors.tiling import HashRounds, KeyRestrictions
from ..lengths import sqrt_len
from .decoding import Cached, attend_cached
from .kinds.base import HeadGroup, HeadKind
from .kinds.common import at_most_seq_len
from .routing.cache import RoutingCache
from .routing.sorted_window import drop_own_key, sort_by_cluster, sorted_window_mask


def default_lsh_settings(n: int) -> tuple[int, int]:
    """(buckets, window) for length n: buckets = round(sqrt(n)) rounded up to an even number (at least 2), window =
    n // buckets, the mean bucket size, so the cost is O(N^1.5) like routing's."""
    buckets = max(2, sqrt_len(n))
    buckets += buckets % 2
    return buckets, max(1, n // buckets)


def lsh_rotations(heads: int, head_dim: int, buckets: int, rounds: int, *, seed: int = 0) -> Tensor:
    """Random rotations R (heads, rounds, head_dim, buckets/2), float32 on the CPU, from a generator seeded by
    ``seed`` (the same values on every machine and every call)."""
    heads, head_dim, rounds = (positive_int(n, x) for n, x in (("heads", heads), ("head_dim", head_dim),
                                                                ("rounds", rounds)))
    buckets = _check_buckets(buckets)
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn(heads, rounds, head_dim, buckets // 2, generator=gen)


def lsh_hash(x: Tensor, rotations: Tensor) -> Tensor:
    """Angular LSH buckets: argmax([xR; -xR]) per head and round. x (B, H, N, D), rotations (H, rounds, D,
    buckets/2) -> (B, H, rounds, N) long in [0, buckets). Computed in float32 or wider, outside autocast; no
    gradient. O(N · D · buckets/2) per head and round."""
    if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a floating (B, H, N, D) tensor, got {getattr(x, 'shape', type(x).__name__)}")
    H, D = x.shape[1], x.shape[3]
    if (not isinstance(rotations, Tensor) or rotations.dim() != 4 or not rotations.is_floating_point()
            or rotations.shape[0] != H or rotations.shape[2] != D):
        raise ValueError(f"rotations must be a floating (H, rounds, D, buckets/2) tensor with H={H}, D={D}, got "
                         f"{getattr(rotations, 'shape', type(rotations).__name__)}")
    acc = torch.promote_types(x.dtype, torch.float32)
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        proj = torch.einsum("bhnd,hrdk->bhrnk", x.to(acc), rotations.to(device=x.device, dtype=acc))
        # argmax over [xR; -xR] without the copy: the larger of max(xR) and -min(xR), the first half on a tie
        top, at = proj.max(-1)
        low, at_low = proj.min(-1)
        return torch.where(top >= -low, at, at_low + proj.shape[-1])


def lsh_mask(q: Tensor, *, buckets: int, rounds: int, window: int, causal: bool = True,
             key_padding_mask: Tensor | None = None, rotations: Tensor | int = 0,
             documents: Tensor | None = None) -> Tensor:
    """The boolean (B, H, N, N) mask of ``lsh_attention`` under ``LSHOptions(buckets, rounds, window)`` with the same
    causal, padding, rotations (a tensor, or the seed ``lsh_attention`` draws them from) and packed documents, from
    its definition (O(N²)):
    the union over rounds of ``sorted_window_mask`` of each round's buckets (with documents, the buckets relabelled
    (document, bucket)), less padded keys, less the query's own key unless it is the only key left."""
    buckets, rounds, window = complete_lsh(LSHOptions(buckets, rounds, window), q.shape[2])
    checked = check_inputs(q, q, q, None, key_padding_mask, documents=documents)
    valid = checked.key_valid
    drawn = isinstance(rotations, int)
    hashes = _hashes(q, buckets, rounds, None if drawn else rotations, rotations if drawn else 0)
    if checked.documents is not None:
        hashes = hashes + checked.documents[:, None, None, :] * buckets
    allow = torch.zeros(*hashes.shape[:2], hashes.shape[-1], hashes.shape[-1], dtype=torch.bool, device=q.device)
    for r in range(hashes.shape[2]):
        allow = allow | sorted_window_mask(hashes[:, :, r], window, causal, exclude_self=False)
    if valid is not None:
        allow = allow & valid[:, :, None, :]
    return drop_own_key(allow, torch.eye(q.shape[2], dtype=torch.bool, device=q.device))


def lsh_attention(
    inputs: Inputs,
    options: LSHOptions,
    executor: Backend = "auto",
    *,
    causal: bool = True,
    rotations: Tensor | None = None,
    seed: int = 0,
) -> Tensor:
    """LSH attention with shared QK: softmax(q_i · k_j · scale) over the union of the rounds' windows, with the
    keys k_j = q_j / |q_j| (the queries normalised to unit length, as in Reformer).

    Args:
        inputs: ``Inputs.of(q, q, v, scale=..., key_padding_mask=...)``: q (B, H, N, D) the queries, given as the
            keys too (the keys are the queries, normalised), v (B, H, N, D) the values; padded keys are never
            attended.
        options: ``LSHOptions``: ``buckets`` hash buckets per round, a positive even integer (None:
            ``default_lsh_settings(N)``); ``rounds`` hash rounds (a query sees the union of its windows over them,
            each key once); ``window`` per round, the entries of the query's bucket it sees (None: N // buckets):
            causal, the last ``window`` positions j <= i of the bucket (i itself included, then dropped unless it
            is the only key); non-causal, those less than ``window`` places from i in the bucket's order.
        executor: the executor that runs each round's band (a name or an ``Executor``).
        causal: see only positions <= i (leak-free: what i sees depends only on positions <= i).
        rotations: (H, rounds, D, buckets/2) random rotations of the hash; None draws them with ``lsh_rotations``
            from ``seed``.
        ``inputs.documents``: packed documents; a query's bucket is then (document, bucket), every round's window
            within its document.

    Returns:
        (B, H, N, D) in the dtype of q; zeros for a query that sees no key (only possible with padding). Exact
        (float64 in, float64 throughout) against ``reference_attention(Inputs.of(q, q/|q|, v), lsh_mask(...))``.
        Time O(rounds · N · window · D + rounds² · N · window + rounds · N · D · buckets/2), memory per head
        O(N · (D + rounds)) kept for the backward on the fused executor (the probabilities recomputed), O(rounds · N
        · window) on the tiles executor (each round's probabilities; the masks of one round at a time).
    """
    refuse_cross(inputs, "LSH attention (its chunks and causal mask)")
    options = check_options("options", options, LSHOptions)
    q, v = inputs.q, inputs.v
    if inputs.k is not q:
        raise ValueError("lsh_attention shares queries and keys (the keys are the unit queries): pass "
                         "Inputs.of(q, q, v, ...), the queries as the keys")
    buckets, rounds, window = complete_lsh(options, q.shape[2])
    hashes, valid, scale = _hashes(q, buckets, rounds, rotations, seed), inputs.key_valid, inputs.scale
    if inputs.documents is not None:  # packed documents: the bucket is (document, bucket), each window in its document
        hashes = hashes + inputs.documents[:, None, None, :] * buckets
    executor = get_executor(executor, q.device)
    B, H, N, D = q.shape
    R = hashes.shape[2]
    # Per round, the sequence sorted by (bucket, position).
    order, inverse, grouped = sort_by_cluster(hashes.reshape(B, H * R, N))[:3]  # (B, H·R, N)
    order, inverse, grouped = (x.view(B, H, R, N) for x in (order, inverse, grouped))
    key_valid = None if valid is None else valid.expand(B, H, N)
    # Round r2 holds a pair when it shares a bucket there and lies within `window` sorted places: labels
    # bucket · (N + window) + sorted index differ by less than `window` (a different bucket lies at least N + window
    # away; when causal the allowed key is earlier, so in a shared bucket it sorts earlier).
    labels = hashes * (N + window) + inverse  # (B, H, R, N) by position
    rounds = executor.runner(q).rounds_run
    if rounds is not None:  # the executor runs the rounds, their merge, the unit keys and the own key itself
        return rounds(q, None, v, HashRounds(order, grouped, labels), window=window, causal=causal, scale=scale,
                      key_valid=key_valid)
    keys = F.normalize(q, dim=-1) * scale  # once for every round, the score scale folded in
    parts = []
    for r in range(R):
        # the round's window over its sorted order, within the bucket, without the query's own key (it comes back
        # below, for queries that see nothing else); a pair an earlier round holds is left to it (its labels, in
        # this round's order): the rounds' key sets are disjoint, the merge exact
        at = order[:, :, r]
        earlier = None if r == 0 else labels[:, :, :r].gather(-1, at[:, :, None].expand(B, H, r, N))
        parts.append(executor.tiled(
            Inputs(q, keys, v, 1.0, None if key_valid is None else key_valid.gather(-1, at)),
            SortedWindow(window, causal, at, grouped[:, :, r], own_key=False), need_lse=True,
            restrict=KeyRestrictions(labels=earlier, label_window=window if r else 0),
        ))
    out, lse = merge_partials(parts)
    # The own key: only when no other key is visible in any round (and it is not padding).
    alone = ~saw_key(lse) if key_valid is None else ~saw_key(lse) & key_valid
    return out + v * alone[..., None]  # out is exactly 0 where a query saw nothing: one pass back, not two


def _check_buckets(buckets: object) -> int:
    buckets = positive_int("buckets", buckets)
    if buckets % 2:
        raise ValueError(f"buckets must be even (a hash is the argmax over [xR; -xR]), got {buckets}")
    return buckets


def complete_lsh(options: LSHOptions, n: int) -> tuple[int, int, int]:
    """(buckets, rounds, window) of ``options`` for sequences of ``n``: buckets None -> ``default_lsh_settings(n)``,
    window None -> n // buckets (at least 1); the model's config fills them in the same way from seq_len."""
    buckets = default_lsh_settings(n)[0] if options.buckets is None else options.buckets
    window = max(1, n // buckets) if options.window is None else options.window
    return buckets, options.rounds, window


def _hashes(q: Tensor, buckets: int, rounds: int, rotations: Tensor | None, seed: int) -> Tensor:
    """(B, H, rounds, N) buckets of the checked queries, under ``rotations`` (default: drawn from ``seed``)."""
    _, H, _, D = q.shape
    if rotations is None:
        rotations = lsh_rotations(H, D, buckets, rounds, seed=seed).to(q.device)
    elif not isinstance(rotations, Tensor) or tuple(rotations.shape) != (H, rounds, D, buckets // 2):
        raise ValueError(f"rotations must have shape (H, rounds, D, buckets/2) = {(H, rounds, D, buckets // 2)}, "
                         f"got {tuple(getattr(rotations, 'shape', ()))}")
    return lsh_hash(q, rotations)


# --- the head kind: how a model uses it ---


@dataclass(frozen=True)
class LSHOptions:
    """options.lsh: buckets per round (even; default round(sqrt(seq_len)) rounded up to even), hash rounds, and keys
    per query per round (at most seq_len; default seq_len // buckets)."""

    buckets: int | None = None
    rounds: int = 2
    window: int | None = None

    def __post_init__(self) -> None:
        if self.buckets is not None:
            _check_buckets(self.buckets)
        positive_int("rounds", self.rounds)
        if self.window is not None:
            positive_int("window", self.window)


@dataclass
class LSHCache:
    """Decoding state of one group of LSH heads: ``rings`` is a ``RoutingCache`` over H·rounds heads (head h,
    round r at h·rounds + r) with one ring of the last ``window`` normalised keys, values and positions per
    bucket. Its tensors have a fixed size: nothing grows with the position."""

    ROWS: ClassVar[tuple[str, ...]] = ("rings",)  # one row per sequence (reorder_rows)

    rings: RoutingCache
    heads: int
    rounds: int

    @property
    def length(self) -> int:
        return self.rings.length

    def fill(self, k: Tensor, v: Tensor, hashes: Tensor) -> None:
        """A prompt into an empty cache: k (normalised), v (B, H, n, D); hashes (B, H, rounds, n)."""
        B, H, n, D = k.shape
        R = self.rounds
        fold = (B, H * R, n, D)
        sort = sort_by_cluster(hashes.reshape(B, H * R, n), self.rings.keys.shape[2])
        self.rings.fill(k[:, :, None].expand(B, H, R, n, D).reshape(fold),
                        v[:, :, None].expand(B, H, R, n, D).reshape(fold), sort)

    def step(self, q: Tensor, k: Tensor, v: Tensor, buckets: Tensor, *, scale: float,
             since: Tensor | None = None) -> Tensor:
        """Write the token at position ``length`` (k normalised; q, k, v (B, H, D), buckets (B, H, rounds)) to its
        ring in every round and return its output (B, H, D): attention over the union of those rings, each
        position once, its own key only when nothing else is there; with ``since`` (B,), packed documents, only
        positions from each row's document's start. O(rounds · window · D) per head."""
        rings, R = self.rings, self.rounds
        B, H, D = q.shape
        t, window = rings.length, rings.keys.shape[3]
        b = torch.arange(B, device=q.device)[:, None]
        h = torch.arange(H * R, device=q.device)[None, :]
        into = buckets.reshape(B, H * R)
        slot = rings.counts[b, h, into] % window  # the oldest entry, once the ring is full
        rings.keys[b, h, into, slot] = k.repeat_interleave(R, 1).to(rings.keys.dtype)
        rings.values[b, h, into, slot] = v.repeat_interleave(R, 1).to(rings.values.dtype)
        rings.positions[b, h, into, slot] = t
        rings.counts[b, h, into] += 1
        rings.length += 1

        keys = rings.keys[b, h, into].view(B, H, R * window, D)
        values = rings.values[b, h, into].view(B, H, R * window, D)
        pos = rings.positions[b, h, into].view(B, H, R * window)
        ranked, by = pos.sort(-1)  # equal positions side by side: keep the first of each
        repeat = torch.cat([torch.zeros_like(ranked[..., :1], dtype=torch.bool), ranked[..., 1:] == ranked[..., :-1]],
                           -1)
        seen = pos >= 0 if since is None else pos >= since[:, None, None]
        allow = seen & ~torch.zeros_like(repeat).scatter(-1, by, repeat)
        allow = drop_own_key(allow, pos == t)
        return attend_cached(q, Cached(keys, values, pos), t, scale=scale, allowed=allow)


class LSHHeads(HeadGroup):
    """LSH heads; the keys are the queries (the model passes them as k), normalised. ``rotations`` (H, rounds, D,
    buckets/2) is a persistent buffer drawn from the build seed, so every rank and a reloaded model agree."""

    def __init__(self, heads: int, head_dim: int, options: LSHOptions, seed: int) -> None:
        super().__init__(heads, head_dim)
        self.options = options
        self.register_buffer("rotations", lsh_rotations(heads, head_dim, options.buckets, options.rounds,
                                                        seed=seed))

    def forward(self, q, k, v, rel_pos, documents=None):
        if rel_pos is not None:
            raise ValueError("lsh heads do not support relative positions")
        return lsh_attention(Inputs(q, q, v, self.scale, documents=documents), self.options, self.executor,
                             rotations=self.rotations)

    def reference_mask(self, q, k):
        o = self.options
        return lsh_mask(q, buckets=o.buckets, rounds=o.rounds, window=o.window, rotations=self.rotations)

    def reference_keys(self, q, k):  # shared QK: the keys are the unit queries
        return F.normalize(q, dim=-1)

    def new_cache(self, batch, max_len, device, dtype):
        o = self.options
        rings = RoutingCache.empty(batch, self.heads * o.rounds, o.buckets, min(o.window, max_len), self.head_dim,
                                   max_len=None, device=device, dtype=dtype)  # the model checks max_len
        return LSHCache(rings, self.heads, o.rounds)

    def decode(self, q, k, v, cache, start, rel_pos, spans=None):
        check_inputs(q, q, v, self.scale, None)
        hashes = lsh_hash(q, self.rotations)  # (B, H, rounds, n)
        keys = F.normalize(q, dim=-1)
        if cache.length == 0 and q.shape[2] > 1:  # a prompt: one forward, then every bucket's last `window`
            out = self(q, k, v, rel_pos, documents=None if spans is None else spans.numbered)
            cache.fill(keys, v, hashes)  # each bucket's newest: its document's are among them (``step`` reads those)
            return out
        outs = [cache.step(q[:, :, i], keys[:, :, i], v[:, :, i], hashes[..., i], scale=self.scale,
                           since=None if spans is None else spans.since[:, i])
                for i in range(q.shape[2])]
        return torch.stack(outs, 2)


def _complete(o: LSHOptions, config: Any) -> LSHOptions:
    if o.window is not None:
        at_most_seq_len("window", o.window, config)
    return LSHOptions(*complete_lsh(o, config.seq_len))


def _keys_per_query(o: LSHOptions, n: int) -> float:
    return o.rounds * min(o.window, n) + o.rounds * o.buckets / 2  # + hashing: buckets/2 projections per round


KIND = HeadKind(
    "lsh",
    lambda o, heads, head_dim, seed: LSHHeads(heads, head_dim, o, seed),
    keys_per_query=_keys_per_query,
    option_type=LSHOptions,
    complete=_complete,
    shares_qk=lambda o: True,
    relative_positions=False,
    documents=True,
    describe=lambda o: f"buckets={o.buckets}, rounds={o.rounds}, w={o.window}",
    summary="shared-QK LSH: per hash round the last `window` positions of the query's bucket, keys once",
)

__all__ = ["default_lsh_settings", "lsh_attention", "lsh_hash", "lsh_mask", "lsh_rotations"]
