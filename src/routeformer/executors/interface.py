"""Executors by name: how the pieces the patterns are built from are computed.

A pattern (``local``, ``strided``, ``fixed``, ``longformer``, ``full``, ``routing``) says which keys each query
sees and builds that from a few pieces; an executor computes the pieces without an N×N matrix. Every pattern
function takes its executor (a name or an ``Executor``) and calls ``get_executor(executor, q.device)`` once; below
it only ``Executor`` values travel. A model resolves ``TransformerConfig.backend`` when it is built (``"auto"``: at its
first forward, for that device; only the CPU's builds the fused kernels) and hands the executor to its head groups
(``TransformerLM``), and again at its first forward on another device:

- ``"fused"`` (``fused/``): C++ CPU kernels compiled at first use, masks computed from the values inside the
  kernel, an online softmax, and a backward that recomputes the probabilities (it keeps O(N · D) per head); the
  default on the CPU. It hands what it does not run (other devices, dtypes other than float32/float64, or every call
  when it cannot be built: a warning says so once) to the tiles executor.
- ``"tiles"`` (``tiles/``): blocked PyTorch with a fused custom operator; runs everywhere.
- ``"flex"`` (``flex/``): FlexAttention, compiled, one fused kernel per piece with a block-sparse ``BlockMask``;
  the default on CUDA. Its ``ranges`` (multi-probe routing) is one call with every (query, range) entry a row
  (``flex/ranges.py``): shapes fixed by N, memory O(N · D) around the kernel. On CPU it runs FlexAttention's
  dense eager operator (correctness tests only).
- ``"auto"`` (a name only, resolved by ``get_executor``): ``"flex"`` on CUDA, ``"fused"`` on the CPU
  (``"tiles"`` where it cannot be built), ``"tiles"`` elsewhere.

``register_executor`` adds another by name. An executor has one operation, ``tiled``, which takes the checked
inputs (``inputs.Inputs``: (B, H, N, D) queries, keys and values, the scale, the keys' validity) and values that
describe the rest (``tiling.py``): a ``Tiling`` (blocks, neighbouring blocks, static and per-tile masks),
``KeyRestrictions`` (groups, the query's own key), the relative terms (``inputs.RelTerms``: the tables and their
``Distances``, unit offsets, explicit deltas or positions) and an optional additive ``bias``; it checks them, refuses
what the executor does not support (``supports``, out of ``FEATURES``) with an error that says which executor
does. A tiling's sequence order (``Tiling.order``) and labelled pairs (``KeyRestrictions.labels``) work on
every executor: one that does not read them natively gets the permuted sequence and a tile mask (``LOWERED``). It
returns ``(out, lse)``: out (B, H, N, D), zeros for a row that sees no key, and lse (B, H, N) or None
(``need_lse=False``), in float32 or wider, exactly ``neg_inf(lse.dtype)`` for a row that sees no key;
``merge_partials`` combines parts over disjoint key sets exactly on that convention. The band, block diagonal,
key subsets, grid columns and ranges are built on ``tiled``, the same for every executor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import flex
from .fused import executor as fused
from .grid import columns_key_valid, from_columns, to_columns
from .inputs import Inputs, RelTerms
from .lowering import in_order, labels_as_mask
from .ranges import KeyOrder, Ranges, broadcast_ranges, check_ranges, range_attention
from .relative import RelativePositions
from .tiles import tiled_attention
from .tiling import Distances, KeyRestrictions, Tiling

FEATURES = ("rows", "tile_mask", "groups", "exclude_self", "distances.delta", "distances.positions", "bias",
            "bias with relative positions", "bias with exclude_self", "order", "labels")
LOWERED = frozenset({"order", "labels"})  # features Executor.tiled turns into others for executors without them


def _features(tiling: Tiling, restrict: KeyRestrictions | None, rel: RelTerms | None,
              bias: Tensor | None) -> list[str]:
    """The ``FEATURES`` one call asks for."""
    distances = None if rel is None else rel.distances
    asked = [name for name, used in (
        ("rows", tiling.rows is not None), ("tile_mask", tiling.tile_mask is not None),
        ("groups", restrict is not None and restrict.groups is not None),
        ("exclude_self", restrict is not None and restrict.exclude_self),
        ("distances.delta", rel is not None and distances.delta is not None),
        ("distances.positions", rel is not None and distances.positions is not None),
        ("bias", bias is not None), ("bias with relative positions", bias is not None and rel is not None),
        ("bias with exclude_self", bias is not None and restrict is not None and restrict.exclude_self),
        ("order", tiling.order is not None), ("labels", restrict is not None and restrict.labels is not None),
    ) if used]
    return asked


@dataclass(frozen=True)
class Executor:
    """An executor: one operation, ``run``, that computes attention over a ``Tiling``, the ``FEATURES`` it
    supports, and the pieces built from it (the same for every executor).

    ``run(inputs, tiling, *, restrict, rel, bias, need_lse)`` is called by ``tiled`` once the arguments are
    checked; see ``tiled`` for their meaning. ``ranges_run`` (the arguments of
    ``ranges``) and ``rounds_run`` (LSH's rounds, ``lsh.lsh_attention``) are its own ways of computing those, where
    it has them. ``delegate(q)`` names the executor that takes a call on queries q instead of this one (None: this
    one): the fused one's is the tiles executor for what its kernels do not take.
    """

    name: str
    run: Callable
    supports: frozenset[str] = frozenset(FEATURES) - LOWERED  # order and labels: lowered unless declared
    ranges_run: Callable | None = None
    rounds_run: Callable | None = None
    delegate: Callable[[Tensor], Executor | None] | None = None

    def runner(self, q: Tensor) -> Executor:
        """The executor that computes a call on queries ``q``: this one, or the one it delegates to."""
        other = None if self.delegate is None else self.delegate(q)
        return self if other is None or other is self else other.runner(q)

    def tiled(self, inputs: Inputs, tiling: Tiling, *, restrict: KeyRestrictions | None = None,
              rel: RelTerms | None = None, bias: Tensor | None = None,
              need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attention of query blocks to spans of key blocks: softmax(q·kᵀ · scale + rel + bias, masked) · v (+ the
        relative value term).

        Args:
            inputs: q (B, H, Nq, D); k, v (B, H, Nk, D), the scale and key validity (``inputs.Inputs``). Nk may
                differ from Nq only for a single tile or with rows.
            tiling: which keys each query block sees (``tiling.Tiling``).
            restrict: optional ``KeyRestrictions`` (self-attention only): groups, the query's own key.
            rel: optional relative-position terms (``inputs.RelTerms``): the tables and how far apart each pair is
                (by index, explicit per tile entry, or between given positions).
            bias: optional additive score term, broadcastable to (B, H, n_blocks, T, S), without a gradient
                (e.g. -log(count) for keys that several hash rounds reach, so that each counts once).
            need_lse: also return the log-sum-exp of each row's scores, for ``merge_partials``.

        Returns:
            out (B, H, Nq, D) with zeros for rows that see no key, and lse (B, H, Nq) in float32 or wider (rows
            that see no key get exactly ``neg_inf(lse.dtype)``, see ``saw_key``) or ``None``. Time O(Nq · S · D),
            memory O(Nq · S) for S keys per span.

        Raises:
            ValueError: the inputs do not fit the tiling, or this executor does not support what the call asks for.
        """
        runner = self.runner(inputs.q)
        if runner is not self:
            return runner.tiled(inputs, tiling, restrict=restrict, rel=rel, bias=bias, need_lse=need_lse)
        Nq, Nk = inputs.q.shape[2], inputs.k.shape[2]
        if bias is not None:
            if not isinstance(bias, Tensor) or not bias.is_floating_point():
                raise ValueError(f"bias must be a floating tensor, got {getattr(bias, 'dtype', type(bias).__name__)}")
            if bias.requires_grad:
                raise ValueError("bias takes no gradient: pass it detached")
        tiling.check(Nq, Nk, restrict, None if rel is None else rel.distances, heads=tuple(inputs.q.shape[:2]))
        if tiling.order is not None and "order" not in self.supports:  # the permuted sequence, and back
            return in_order(self.tiled, inputs, tiling, restrict=restrict, rel=rel, bias=bias, need_lse=need_lse)
        if restrict is not None and restrict.labels is not None and "labels" not in self.supports:
            tiling, restrict = labels_as_mask(tiling, restrict)
        missing = [f for f in _features(tiling, restrict, rel, bias) if f not in self.supports]
        if missing:
            others = [repr(name) for name, ex in EXECUTORS.items() if all(f in ex.supports for f in missing)]
            who = " and ".join([", ".join(others[:-1]), others[-1]] if len(others) > 1 else others)
            raise ValueError(f"the {self.name!r} executor does not support {', '.join(missing)}"
                             + (f"; {who} {'does' if len(others) == 1 else 'do'}" if others else ""))
        return self.run(inputs, tiling, restrict=restrict, rel=rel, bias=bias, need_lse=need_lse)

    def band(self, inputs: Inputs, *, window: int, causal: bool, restrict: KeyRestrictions | None = None,
             rel: RelTerms | None = None, need_lse: bool = False,
             order: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Sliding window over the sequence order of q, k, v (or over q[order], k[order], v[order]: see
        ``Tiling.order``): causal i - window < j <= i, else |i - j| < window (``Tiling.band``). q, k, v:
        (B, H, N, D) -> out (B, H, N, D), lse (B, H, N) or None. Time O(N · window · D), memory O(N · window)."""
        tiling = Tiling.band(window, inputs.q.shape[2], causal)
        if order is not None:
            tiling = dataclasses.replace(tiling, order=order)
        return self.tiled(inputs, tiling, restrict=restrict, rel=rel, need_lse=need_lse)

    def block_diagonal(self, inputs: Inputs, block: int, *, causal: bool, rel: RelTerms | None = None,
                       need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attention within blocks of ``block`` positions (j <= i too when causal); block >= N is one dense tile.

        q, k, v: (B, H, N, D) -> out (B, H, N, D), lse (B, H, N) or None. Time O(N · block · D), memory
        O(N · block).
        """
        size = min(block, inputs.q.shape[2])
        # causal as the offsets j - i <= 0 within a block, not a mask tensor: read by executors from the tiling,
        # with no host read of a device tensor (flex's relative value pass enumerates those offsets)
        tiling = Tiling(block=size, offsets=(1 - size, 0)) if causal else Tiling(block=size)
        return self.tiled(inputs, tiling, rel=rel, need_lse=need_lse)

    def subset(self, inputs: Inputs, key_idx: Tensor, allow: Tensor | None, *, rel: RelTerms | None = None,
               need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """Every query against the keys at positions ``key_idx`` (M,) only, under ``allow`` (N, M) (rows may be
        empty).

        q, k, v: (B, H, N, D); key_valid (B, 1 or H, N) -> out (B, H, N, D) (zeros where a row sees nothing), lse
        (B, H, N) or None. One dense (N, M) tile of the gathered keys: time O(N · M · D), memory O(N · M);
        relative distances key_idx[m] - i (``rel``'s tables), by gathers.
        """
        q, key_valid = inputs.q, inputs.key_valid
        N = q.shape[2]
        if rel is not None:
            rel = rel.at(Distances(delta=key_idx[None, :] - torch.arange(N, device=q.device)[:, None]))
        gathered = inputs.with_(k=inputs.k[:, :, key_idx], v=inputs.v[:, :, key_idx],
                                key_valid=None if key_valid is None else key_valid[:, :, key_idx])
        return self.tiled(gathered, Tiling.dense(N, allow=allow), rel=rel, need_lse=need_lse)

    def columns(self, inputs: Inputs, width: int, *, causal: bool, gap: int, rel: RelTerms | None = None,
                need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """Keys in the query's column of the (N / width, width) grid at least ``gap`` rows away (earlier when
        causal): the Sparse Transformer's strided heads, by the transpose trick (``grid.py``).

        q, k, v: (B, H, N, D) -> out (B, H, N, D), lse (B, H, N) or None. Each column is one dense (R, R) tile,
        R = ceil(N / width); relative distances are width · (row difference). Time O(N · R · D), memory O(N · R).
        """
        q = inputs.q
        B, _, N, _ = q.shape
        rows = -(-N // width)
        r = torch.arange(rows, device=q.device)
        offset = r[None, :] - r[:, None]  # key row - query row
        if causal:
            allow: Tensor | None = offset <= -gap
        else:
            allow = offset.abs() >= gap if gap else None
        grid = Inputs(to_columns(q, width), to_columns(inputs.k, width), to_columns(inputs.v, width),  # (B·w, H, R, D)
                      inputs.scale, columns_key_valid(inputs.key_valid, B, N, width, q.device))
        out, lse = self.tiled(grid, Tiling.dense(rows, allow=allow), need_lse=need_lse,
                              rel=None if rel is None else rel.at(Distances(unit=width)))
        return from_columns(out, width, N), None if lse is None else from_columns(lse, width, N)

    def ranges(self, inputs: Inputs, spans: Ranges, *, order: KeyOrder | None = None,
               rel_pos: RelativePositions | None = None, need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """Each query entry against its own contiguous range of keys (``ranges.Ranges``: [lo, hi), at most
        ``width`` keys, the ``merge`` entries of a query row as one softmax, the positions for relative distances),
        over the keys in ``order`` (``ranges.KeyOrder``; default as they are). An executor with its own
        ``ranges_run`` computes it there (the fused one: ranges tested and keys gathered inside the kernel); else
        tiles of entries per stretch of keys, each a tile of ``tiled`` (``ranges.range_attention``)."""
        check_ranges(inputs.q, spans, rel_pos)
        spans, order = broadcast_ranges(inputs, spans, order)
        runner = self.runner(inputs.q)
        if runner.ranges_run is not None:
            return runner.ranges_run(inputs, spans, order=order, rel_pos=rel_pos, need_lse=need_lse)
        return range_attention(runner.tiled, inputs, spans, order=order, rel_pos=rel_pos, need_lse=need_lse)

    @property
    def native_ranges(self) -> bool:
        """Whether ``ranges`` is computed by the executor itself (no tile masks built in PyTorch)."""
        return self.ranges_run is not None


def _unless_fused_takes(q: Tensor) -> Executor | None:
    """The fused executor's delegate: the tiles executor for queries its kernels do not take (off the CPU, half
    dtypes, or no kernels: a warning said why, once)."""
    return None if fused.takes(q) else EXECUTORS["tiles"]


EXECUTORS: dict[str, Executor] = {
    # LSH's labelled pairs run in its own rounds operator there; a tiling's labels are lowered to a tile mask
    "fused": Executor("fused", fused.fused_tiled, frozenset(FEATURES) - {"labels"}, ranges_run=fused.fused_ranges,
                      rounds_run=fused.fused_rounds, delegate=_unless_fused_takes),
    "tiles": Executor("tiles", tiled_attention),
    "flex": Executor("flex", flex.tiled, ranges_run=flex.flex_ranges),
}


Backend = str | Executor  # a registered executor's name, "auto", or an executor resolved already


def check_backend(name: Backend) -> Backend:
    """``name`` if it is an executor, ``"auto"`` or a registered executor's name; a ValueError lists the choices
    otherwise."""
    if not isinstance(name, Executor) and name != "auto" and name not in EXECUTORS:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(EXECUTORS)}")
    return name


def resolve_backend(name: Backend, device: torch.device | str | None) -> str:
    """The executor ``name`` stands for on ``device``: ``"auto"`` is ``"flex"`` on CUDA, ``"fused"`` on the CPU
    (``"tiles"`` when its kernels cannot be built: a warning says why, once), ``"tiles"`` elsewhere."""
    if isinstance(name, Executor):
        return name.name
    if check_backend(name) != "auto":
        return name
    kind = torch.device(device or "cpu").type
    if kind == "cuda":
        return "flex"
    return "fused" if kind == "cpu" and fused.available() else "tiles"


def describe_backend(name: Backend, device: torch.device | str | None, dtype: torch.dtype | None = None) -> str:
    """One line for the banners of ``train``, ``evaluate``, ``sample`` and ``bench``: the executor ``name`` runs
    as on ``device`` (for inputs of ``dtype``, when given) and why, e.g. "attention: fused C++ kernel (AVX512,
    16-lane vectors)" or "attention: tiles (fused kernel unavailable: compile error ..., log: ...)". Builds the
    kernels if they are not yet."""
    kind = torch.device(device or "cpu").type
    chosen = resolve_backend(name, device)
    how = "asked for" if chosen == name else f"the default on {kind}"
    if chosen == "fused":
        if kind != "cpu":  # the executor hands every call off the CPU to tiles
            return f"attention: tiles (fused asked for, but its kernels run on the CPU only, not {kind})"
        status = fused.KERNELS.status()
        if not status.ok:  # the executor hands every call to tiles
            return f"attention: tiles (fused asked for, but its kernel is unavailable: {status.why()})"
        if dtype is not None and dtype not in fused.DTYPES:
            return (f"attention: tiles (the fused kernel takes float32 and float64, not "
                    f"{str(dtype).removeprefix('torch.')})")
        line = (f"attention: fused C++ kernel ({status.loaded}, {torch.ops.routeformer_fused.vector_width()}-lane "
                f"vectors)")
        return line + (f" instead of its {status.wanted} build ({status.why()})" if status.failures else "")
    if chosen == "tiles" and name == "auto" and kind == "cpu":
        return f"attention: tiles (fused kernel unavailable: {fused.KERNELS.status().why()})"
    return f"attention: {chosen} ({how})"


def get_executor(backend: Backend = "auto", device: torch.device | str | None = None) -> Executor:
    """The executor ``backend`` is on ``device``: an executor as it is, a name looked up (see ``resolve_backend``)."""
    if isinstance(backend, Executor):
        return backend
    return EXECUTORS[resolve_backend(backend, device)]


def register_executor(name: str, executor: Executor, *, replace: bool = False) -> None:
    """Make ``executor`` available as ``name``; an existing name is replaced only with ``replace=True``."""
    if name in EXECUTORS and not replace:
        raise ValueError(f"attention executor {name!r} is already registered; pass replace=True to replace it")
    if not isinstance(executor, Executor) or not callable(executor.run):
        raise ValueError(f"attention executor {name!r} must be an Executor with a callable run")
    unknown = sorted(set(executor.supports) - set(FEATURES))
    if unknown:
        raise ValueError(f"attention executor {name!r} names unknown features {unknown}; known: {', '.join(FEATURES)}")
    EXECUTORS[name] = executor
