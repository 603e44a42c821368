"""What every head kind provides: a ``HeadGroup`` (the heads of a layer using the kind, with their forward, their
decoding cache and their per-step hook) and a ``HeadKind`` (the registry entry: typed options read from the model
config's ``options[section]``, the cost per query, whether keys are the queries, whether relative positions apply, how
to build the group).

A new kind is one file: a ``HeadGroup`` subclass and ``register_kind(HeadKind(...))`` (see ``registry.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...checks import check_scale
from ...documents import DocumentSpans
from ...executors import Executor, Inputs, get_executor
from ...executors.relative import RelativePositions
from ..decoding import Cached, attend_cached, seen
from ..kernels import attend_cached_kernel, kernel_scale
from ..reference import reference_attention, reference_scores, reference_weights


@dataclass
class KeyStore:
    """Keys and values of selected positions: (B, H, capacity, D) buffers and their positions (capacity,).

    Positions arrive in increasing order from position 0 (a model's cache always starts there). ``ring``: position
    p goes to slot p mod capacity (every position passes through a ring); otherwise slots fill once, in arrival
    order. Either way the filled slots are the first min(count, capacity).
    """

    ROWS: ClassVar[tuple[str, ...]] = ("keys", "values")  # one row per sequence (reorder_rows)

    keys: Tensor
    values: Tensor
    positions: Tensor  # (capacity,), -1 for an empty slot
    ring: bool
    count: int = 0

    @classmethod
    def empty(cls, batch: int, heads: int, capacity: int, head_dim: int, *, ring: bool, device, dtype) -> KeyStore:
        return cls(torch.zeros(batch, heads, capacity, head_dim, device=device, dtype=dtype),
                   torch.zeros(batch, heads, capacity, head_dim, device=device, dtype=dtype),
                   torch.full((capacity,), -1, dtype=torch.long, device=device), ring)

    @property
    def capacity(self) -> int:
        return self.positions.numel()

    def add(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Store k, v (B, H, n, D) of the given increasing positions (n,)."""
        n, cap = positions.numel(), self.capacity
        if n == 0:
            return
        if self.ring:
            if n > cap:  # only the last `capacity` can survive
                k, v, positions = k[:, :, -cap:], v[:, :, -cap:], positions[-cap:]
            slots = positions % cap
        else:
            if self.count + n > cap:
                raise ValueError(f"max_len: the cache holds {cap} positions and is full")
            slots = slice(self.count, self.count + n)
        self.keys[:, :, slots] = k.to(self.keys.dtype)
        self.values[:, :, slots] = v.to(self.values.dtype)
        self.positions[slots] = positions
        self.count += n

    def filled(self) -> Cached:
        """Keys, values (B, H, m, D) and positions (m,) of the filled slots (views, no copy)."""
        m = min(self.count, self.capacity)
        return Cached(self.keys[:, :, :m], self.values[:, :, :m], self.positions[:m])


class HeadGroup(nn.Module):
    """Some heads of a layer using one kind, always causal. q, k, v: (B, h, N, D) -> (B, h, N, D).

    What a subclass writes: ``forward``; for decoding, ``store_size`` (or ``new_cache`` / ``keep`` / ``step``)
    unless every position is kept; ``reference_mask`` (the explicit mask of what each query sees, for the tests)
    or ``reference`` (a dense definition, for kinds that are not a mask over softmax attention); ``aux_loss``
    and ``after_optimizer_step`` when the kind learns outside the gradient.

    Decoding: ``new_cache`` makes the group's cache (by default one ``KeyStore`` of ``store_size``), ``keep``
    stores what later queries need of new positions, ``step`` is the output of the query at position t.
    """

    kernel = "exp"  # the similarity the heads normalise (``attention/kernels.py``); reference and attend follow it
    causal = True  # False: an encoder's heads (``HeadKind.encoder`` builds them), every key of the sequence visible

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.scale = head_dim ** -0.5
        self._executor: Executor | None = None

    @property
    def executor(self) -> Executor:
        """The executor (``routeformer.executors``) of kinds that run on one: the model sets its device's
        (``TransformerLM``); a group on its own, until one is set, takes that of the device its buffers are on (the
        CPU's without any)."""
        if self._executor is not None:
            return self._executor
        held = next(self.buffers(), None)
        return get_executor("auto", "cpu" if held is None else held.device)

    @executor.setter
    def executor(self, executor: Executor) -> None:
        if not isinstance(executor, Executor):
            raise ValueError(f"executor must be an Executor (routeformer.executors.get_executor(name)), got "
                             f"{executor!r}")
        self._executor = executor

    @property
    def kernel_scale(self) -> float | None:
        """The ``scale`` argument for this group's kernel: the heads' scale, or None for elu (it takes none)."""
        return None if self.kernel == "elu" else self.scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None) -> Tensor:
        raise NotImplementedError

    def inputs(self, q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None = None,
               key_padding_mask: Tensor | None = None) -> Inputs:
        """The call value of the heads' public function: q, k, v (B, h, N, D) from the layer (well formed: no
        check), at the scale a public function's ``Inputs.of`` resolves (1/sqrt(D), which ``self.scale`` may
        differ from in the last bit), the model's checked documents (B, N) or None, and an encoder's (B, N) key
        padding (True = a real key) or None."""
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]
        return Inputs(q, k, v, check_scale(None, self.head_dim), valid, documents=documents)

    def aux_loss(self) -> Tensor | None:
        """A loss term of the last training forward to add to the model's (routing: the commitment loss)."""
        return None

    def after_optimizer_step(self, step: int | None, group: dist.ProcessGroup | None) -> bool:
        """Called once per optimiser step, after ``optimizer.step()``, on every rank (``step``: the step just
        taken, when the caller counts). Returns whether the group had anything to do (routing: the k-means step)."""
        return False

    def replicated_state(self) -> dict[str, Tensor]:
        """The buffers every rank must hold bit-identical while training in parallel (routing: the router's
        centroids, EMA sums and counts, projections, balancing bias and warm-up count), by name within this group;
        state a rank keeps to itself until the next all-reduce (pending statistics) is not in it."""
        return {}

    # --- meaning, for tests and analysis ---------------------------------------------------------------------
    def reference_mask(self, q: Tensor, k: Tensor) -> Tensor | None:
        """The boolean mask (N, N), (h, N, N) or (B, h, N, N) of what each query attends to, or None when the kind
        is not a mask over softmax attention (then ``reference`` is its definition)."""
        return None

    def reference_bias(self, q: Tensor, k: Tensor) -> Tensor | None:
        """An additive score term (B, h, N, N) the heads add under ``reference_mask`` (routing's hand-over penalty),
        or None."""
        return None

    def reference(self, q: Tensor, k: Tensor, v: Tensor, rel_pos: RelativePositions | None = None) -> Tensor:
        """The dense O(N²) definition of ``forward``: by default attention under ``reference_mask`` (plus
        ``reference_bias``) with the group's ``kernel`` (softmax unless a subclass sets another)."""
        mask = self.reference_mask(q, k)
        if mask is None:
            raise NotImplementedError(f"{type(self).__name__} defines neither reference_mask nor reference")
        inputs = Inputs.of(q, self.reference_keys(q, k), v, scale=self.kernel_scale)
        return reference_attention(inputs, mask, rel=rel_pos, kernel=self.kernel, bias=self.reference_bias(q, k))

    def reference_keys(self, q: Tensor, k: Tensor) -> Tensor:
        """The keys the heads score against (B, h, N, D): ``k``, unless the kind derives them (LSH: unit queries)."""
        return k

    def reference_weights(self, q: Tensor, k: Tensor, rel_pos: RelativePositions | None = None,
                          mask: Tensor | None = None) -> Tensor:
        """The attention weights (B, h, N, N) of ``reference`` (rows sum to 1 over what each query sees, 0 where it
        sees nothing), for analysis: the heads' scores and kernel under ``mask`` (default ``reference_mask``; a
        subset of it gives the kernel normalised over that subset). NotImplementedError for kinds that are not a
        mask over attention."""
        mask = self.reference_mask(q, k) if mask is None else mask
        if mask is None:
            raise NotImplementedError(f"{type(self).__name__} heads are not a mask over attention: no weights")
        return reference_weights(q, self.reference_keys(q, k), mask, scale=self.kernel_scale, rel_pos=rel_pos,
                                 kernel=self.kernel, bias=self.reference_bias(q, k))

    def reference_scores(self, q: Tensor, k: Tensor, rel_pos: RelativePositions | None = None) -> Tensor:
        """What ``reference_weights`` normalises, before any mask (B, h, N, N): the heads' logits (kernel values
        for 'poly2' / 'elu'), for analysis that normalises them under several masks
        (``attention.reference.normalise_scores``, which then gives ``reference_weights`` bit for bit)."""
        return reference_scores(q, self.reference_keys(q, k), scale=self.kernel_scale, rel_pos=rel_pos,
                                kernel=self.kernel, bias=self.reference_bias(q, k))

    num_clusters: int | None = None  # kinds that route (``clusters`` not None) set it: the clusters it draws from
    band: int | None = None  # kinds whose heads see exactly the last ``band`` keys whatever the content (local: its
    # window) set it: what such a head reaches in one layer (analysis counts keys beyond it as far)

    def clusters(self, q: Tensor, k: Tensor) -> Tensor | None:
        """The cluster of every query, (B, h, N) long in [0, num_clusters), for kinds that route (analysis colours
        and counts by it); None for the others."""
        return None

    def reach(self, q: Tensor, k: Tensor, rows: Tensor, cols: Tensor, sources: Tensor) -> dict[str, Tensor]:
        """Diagnostics for the recall benchmark: what the queries at (``rows``, ``cols``) could reach of the keys at
        (``rows``, ``sources``), as scalars by name (routing: 'balance', 'in_cluster', 'in_window'). Default none."""
        return {}

    # --- decoding -------------------------------------------------------------------------------------------
    def store_size(self, max_len: int) -> tuple[int, bool]:
        """(capacity, ring) of the key store: by default every position, filled once."""
        return max_len, False

    def new_cache(self, batch: int, max_len: int, device, dtype):
        capacity, ring = self.store_size(max_len)
        return KeyStore.empty(batch, self.heads, capacity, self.head_dim, ring=ring, device=device, dtype=dtype)

    def keep(self, cache, k: Tensor, v: Tensor, positions: Tensor, start: int, since: Tensor | None = None) -> None:
        """Store what later queries will need of the new positions start, start + 1, … (``positions``). ``since``
        (B,): packed documents, each row's document's first position (the row's earlier positions are never seen
        again); a cache that keeps positions masks them at each ``step`` instead, so by default it is not read."""
        cache.add(k, v, positions)

    def step(self, q: Tensor, cache, t: int, rel_pos: RelativePositions | None,
             since: Tensor | None = None) -> Tensor:
        """Output (B, h, D) of the query at t. Default: every filled slot (a ring then holds just what t sees).
        ``since`` (B,): packed documents, each row's document's first position: nothing before it is seen."""
        keys, values, positions = cache.filled()
        return self.attend(q, keys, values, positions, t, rel_pos, allowed=seen(positions, since))

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, t: int,
               rel_pos: RelativePositions | None, allowed: Tensor | None = None,
               bias: Tensor | None = None) -> Tensor:
        """The query at t (B, h, D) over cached keys, values (B, h, M, D) at ``positions`` (M,) or (B, h, M), those
        ``allowed`` (broadcast to (B, h, M); packed documents: ``decoding.seen`` adds each row's ``since``)."""
        if self.kernel != "exp":  # the config allows no relative positions (nor a bias) with another kernel
            return attend_cached_kernel(q, keys, values, self.kernel, kernel_scale(self.kernel, self.kernel_scale,
                                                                                   self.head_dim), allowed)
        return attend_cached(q, Cached(keys, values, positions), t, scale=self.scale, allowed=allowed,
                             rel_pos=rel_pos, bias=bias)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache, start: int,
               rel_pos: RelativePositions | None, spans: DocumentSpans | None = None) -> Tensor:
        """Outputs (B, h, n, D) of n new positions from ``start`` on; equal to the causal forward over the whole
        prefix. The caller checks that they fit the cache. ``spans``: packed documents of the new positions
        (``documents.continue_documents``): a prompt of several, a row beginning a new one."""
        n = q.shape[2]
        positions = torch.arange(start, start + n, device=q.device)
        if start == 0 and n > 1:  # a prompt: one forward, then keep what the future needs
            if spans is None or spans.numbered is None:
                out = self(q, k, v, rel_pos)
            else:
                out = self(q, k, v, rel_pos, documents=spans.numbered)
            if spans is None:  # (a kind written before documents takes no ``since``)
                self.keep(cache, k, v, positions, start)
            else:
                self.keep(cache, k, v, positions, start, spans.since[:, -1])
            return out
        outs = []
        for i in range(n):
            one = (cache, k[:, :, i:i + 1], v[:, :, i:i + 1], positions[i:i + 1], start + i)
            if spans is None:
                self.keep(*one)
                outs.append(self.step(q[:, :, i], cache, start + i, rel_pos))
            else:
                self.keep(*one, spans.since[:, i])
                outs.append(self.step(q[:, :, i], cache, start + i, rel_pos, spans.since[:, i]))
        return torch.stack(outs, 2)


class Warmup(NamedTuple):
    """A phase of how a kind starts training (``HeadKind.warmup``): until optimiser step ``steps`` (and after the
    phases before it) it costs ``keys_per_query(n)`` keys per query at context n, trained on sequences of ``length``
    (None: the model's)."""

    steps: int
    keys_per_query: Callable[[int], float]
    length: int | None = None


@dataclass(frozen=True)
class HeadKind:
    """A registry entry: everything the rest of the package knows about a kind of head.

    Fields:
        name: what ``TransformerConfig.attention`` calls it ('local', 'routing', ...).
        build: (options, heads, head_dim, seed) -> HeadGroup. ``seed`` differs per layer and group (for fixed
            random projections).
        keys_per_query: (options, n) -> the mean number of keys one query scores at context n (plus any other
            per-query work in key-equivalents); ``TransformerLM.flops_per_token`` counts it.
        warmup: (options) -> a ``Warmup`` or a tuple of them in order (phases), for kinds that start training
            another way (routing's dense warm-up and hand-over): until a phase's ``steps`` optimiser steps the kind
            costs its ``keys_per_query(n)`` instead, and asks to be trained on sequences of ``length`` (the
            trainers cut each batch into sequences that long; None: the model's).
        option_type: the kind's options dataclass, read from ``TransformerConfig.options[section]`` (a mapping of
            field to value, or an instance); every field has a default, and its ``__post_init__`` checks what can
            be checked without the model (errors name the field). None: the kind takes no options.
        section: the key of ``TransformerConfig.options`` the kind reads (default: its name); kinds that are parts
            of one mechanism share one (strided_a1 and strided_a2 read 'strided').
        complete: (options, config) -> the options with the model's defaults filled in (None fields derived from
            seq_len, head_dim, ...) and checked against the model (errors name ``options.<section>.<field>``);
            the config stores what it returns. Default: the options as given.
        shares_qk: (options) -> whether the keys are the queries (the layer then projects no keys for it).
        relative_positions: whether the kind supports Shaw et al.'s relative positions (the config says so
            clearly when it does not); a bool, or (options) -> bool when it depends on them.
        on_executor: whether the heads run on an attention executor, so that ``TransformerConfig.backend`` chooses
            how they are computed; a bool, or (options) -> bool. Kinds with their own computation (poly2 linear
            heads, the poly2 / elu kernels) say False.
        describe: (options) -> a short summary of the options for tables ('window=128'); default the dataclass.
        summary: one line for ``--help`` and tables.
        documents: whether the heads honour packed documents (a query sees only its own document's keys): their
            ``forward`` then takes ``documents=`` (B, N) numbered from 0 per row; a bool, or (options) -> bool.
            A model refuses documents while any of its kinds says False.
        encoder: (options, heads, head_dim, seed) -> the kind's non-causal heads, an encoder's (every key of the
            sequence visible; ``HeadGroup.causal`` False); their ``forward`` also takes ``key_padding_mask=`` (B, N),
            True = a real key, which no query reads and no statistic counts. None: the kind has no encoder form
            (an encoder that names it is refused, naming those that have one: ``ENCODER_KINDS``).
    """

    name: str
    build: Callable[[Any, int, int, int], HeadGroup]
    keys_per_query: Callable[[Any, int], float]
    warmup: Callable[[Any], Warmup | tuple[Warmup, ...]] | None = None
    option_type: type | None = None
    section: str = ""
    complete: Callable[[Any, Any], Any] | None = None
    shares_qk: Callable[[Any], bool] | None = None
    relative_positions: bool | Callable[[Any], bool] = True
    on_executor: bool | Callable[[Any], bool] = True
    describe: Callable[[Any], str] | None = None
    summary: str = ""
    documents: bool | Callable[[Any], bool] = False
    encoder: Callable[[Any, int, int, int], HeadGroup] | None = None

    @property
    def options_key(self) -> str:
        """Where its options live: ``TransformerConfig.options[options_key]``."""
        return self.section or self.name

    @property
    def option_fields(self) -> list[str]:
        """The fields a section of this kind may set (its options dataclass's constructor fields)."""
        return [f.name for f in dataclasses.fields(self.option_type) if f.init] if self.option_type else []

    def read_options(self, given: Any) -> Any:
        """``given`` (a mapping of field to value, an ``option_type`` instance or None) as the typed options,
        checked by the dataclass; errors name ``options.<section>``'s fields."""
        return read_typed_options(self.option_type, given, f"options.{self.options_key}", f"{self.name} heads")

    def resolve(self, given: Any, config: Any) -> Any:
        """The typed options of this kind in a model described by ``config``, its defaults filled in and checked
        against it (``complete``)."""
        options = self.read_options(given)
        if self.complete is None:
            return options
        try:
            return self.complete(options, config)
        except ValueError as err:
            raise ValueError(f"options.{self.options_key}: {err}") from None

    def phases(self, options: Any) -> tuple[Warmup, ...]:
        """The warm-up's phases (``warmup``), in order; () for kinds without one."""
        if self.warmup is None:
            return ()
        found = self.warmup(options)
        return (found,) if isinstance(found, Warmup) else tuple(found)

    def cost(self, options: Any, n: int, step: int | None = None) -> float:
        """Keys per query at context ``n``, at optimiser step ``step`` (None: after any warm-up)."""
        if step is not None:
            for warm in self.phases(options):
                if step < warm.steps:
                    return warm.keys_per_query(n)
        return self.keys_per_query(options, n)

    def supports_relative(self, options: Any) -> bool:
        rel = self.relative_positions
        return bool(rel(options)) if callable(rel) else bool(rel)

    def honours_documents(self, options: Any) -> bool:
        found = self.documents
        return bool(found(options)) if callable(found) else bool(found)

    def runs_on_executor(self, options: Any) -> bool:
        uses = self.on_executor
        return bool(uses(options)) if callable(uses) else bool(uses)

    def heads_share_qk(self, options: Any) -> bool:
        return bool(self.shares_qk(options)) if self.shares_qk is not None else False

    def describe_options(self, options: Any) -> str:
        if self.describe is not None:
            return self.describe(options)
        if options is None or not dataclasses.is_dataclass(options):
            return "-"
        return ", ".join(f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options))


def non_causal(group: HeadGroup) -> HeadGroup:
    """``group`` as an encoder's heads (``HeadKind.encoder`` for kinds whose heads read ``causal``)."""
    group.causal = False
    return group


def read_typed_options(option_type: type | None, given: Any, where: str, what: str) -> Any:
    """``given`` (a mapping of field to value, an ``option_type`` instance or None) as ``option_type``, checked by
    the dataclass; errors name ``where`` (the section, 'options.local') and its fields, and ``what`` takes them ('local
    heads'). A kind without options (``option_type`` None) takes none."""
    if option_type is None:
        if given:
            raise ValueError(f"{where}: {what} take no options, got {given!r}")
        return None
    if isinstance(given, option_type):
        return given
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise ValueError(f"{where} must be a table of field = value, got {given!r}")
    names = [f.name for f in dataclasses.fields(option_type) if f.init]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; {what} take {', '.join(sorted(names)) or 'none'}")
    try:
        return option_type(**given)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None
