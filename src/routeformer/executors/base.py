"""The executor: one operation, ``tiled``, over a piece of a pattern (``pieces.py``: a ``Tiling``, a band, a block
diagonal, a key subset, grid columns), ``ranges`` built on it, the ``FEATURES`` an executor declares, and the
registry the backends fill (``EXECUTORS``; names and lookup in ``interface.py``).

A backend gives ``run`` (``tiles.tiled_attention``, ``fused.executor.fused_tiled``, ``flex.tiled``), which
``tiled`` calls once the piece is laid out and the call checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from .inputs import Inputs, RelTerms, refuse_documents
from .lowering import in_order, labels_as_mask
from .pieces import Laid, Piece, SortedWindow, documents_folded, finish, lay
from .ranges import KeyOrder, Ranges, broadcast_ranges, check_ranges, range_attention
from .relative import RelativePositions
from .tiling import KeyRestrictions, Tiling

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
    """An executor: one operation, ``tiled``, that computes attention over a piece of a pattern, and the
    ``FEATURES`` it supports.

    ``run(inputs, tiling, *, restrict, rel, bias, need_lse)`` is called by ``tiled`` once the piece is laid out
    and the arguments checked; see ``tiled`` for their meaning. ``ranges_run`` (the arguments of ``ranges``) and
    ``rounds_run`` (LSH's rounds, ``lsh.lsh_attention``) are its own ways of computing those, where it has them.
    ``delegate(q)`` names the executor that takes a call on queries q instead of this one (None: this one): the
    fused one's is the tiles executor for what its kernels do not take. ``pieces_run``: (piece type, run) pairs,
    the pieces this executor computes in a way of its own instead of the tiling they lay out (the flex executor's
    ``SortedWindow``: block tables from its intervals); ``run(inputs, piece, *, restrict, rel, bias, need_lse)``
    gets the call once it is checked, with the restrictions as laid out.

    Besides attention over a piece, the steps where a backend has kernels of its own: ``route_run(r, centroids,
    bias, key_padding_mask, probes, observe)`` the causal router's (``routes.Routed``, e.g.
    ``fused.routes.fused_route``), ``select_run(q, k, block, top, bound, documents)`` block selection's
    (``fused.selection.fused_select_blocks``), ``scan_run(q, k, v, kernel, chunk, key_valid, documents)`` causal
    attention through a ``tiling.FeatureKernel``'s features, chunk None its own choice, each packed document a
    sequence of its own (``fused.scan.fused_feature_scan``),
    ``probes_run(key_clusters, probes, window, exclude_self, own_when_alone)`` multi-probe routing's key ranges
    (lo, hi) (``fused.probes.fused_probe_ranges``), ``vectors_run(x, projection)`` the router's unit routing vectors
    x / ||x|| · W_R with their gradient (``fused.vectors.fused_routing_vectors``), ``activation_run(x)`` the
    model's activation x · sigmoid(1.702 x) with its gradient (``fused.op.sigmoid_gelu``);
    each may return None for a call it does not take, and an executor without them (tiles) leaves them to
    PyTorch's operators in the mechanism, the definition. Read them through ``runner(q)``: the executor that
    computes a call on q.
    """

    name: str
    run: Callable
    supports: frozenset[str] = frozenset(FEATURES) - LOWERED  # order and labels: lowered unless declared
    ranges_run: Callable | None = None
    rounds_run: Callable | None = None
    delegate: Callable[[Tensor], Executor | None] | None = None
    pieces_run: tuple[tuple[type, Callable], ...] = ()
    route_run: Callable | None = None
    select_run: Callable | None = None
    scan_run: Callable | None = None
    probes_run: Callable | None = None
    vectors_run: Callable | None = None
    activation_run: Callable | None = None

    def __post_init__(self) -> None:
        if not callable(self.run):
            raise ValueError(f"attention executor {self.name!r} must be an Executor with a callable run")

    def runner(self, q: Tensor) -> Executor:
        """The executor that computes a call on queries ``q``: this one, or the one it delegates to."""
        other = None if self.delegate is None else self.delegate(q)
        return self if other is None or other is self else other.runner(q)

    def tiled(self, inputs: Inputs, piece: Piece, *, restrict: KeyRestrictions | None = None,
              rel: RelTerms | None = None, bias: Tensor | None = None,
              need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attention of query blocks to spans of key blocks: softmax(q·kᵀ · scale + rel + bias, masked) · v (+ the
        relative value term).

        Args:
            inputs: q (B, H, Nq, D); k, v (B, H, Nk, D), the scale and key validity (``inputs.Inputs``). Nk may
                differ from Nq only for a single tile or with rows.
            piece: which keys each query block sees: a ``tiling.Tiling``, or a piece that lays one out
                (``pieces.Band``, ``BlockDiagonal``, ``Subset``, ``Columns``).
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
            return runner.tiled(inputs, piece, restrict=restrict, rel=rel, bias=bias, need_lse=need_lse)
        if inputs.documents is not None and isinstance(piece, SortedWindow):  # its groups part the documents too
            piece, inputs = documents_folded(piece, inputs.documents), inputs.with_(documents=None)
        laid = self.checked(inputs, piece, restrict, rel, bias)
        own = self.piece_run(piece)
        if own is not None:  # this executor's own way with the piece, the call checked as laid out
            return own(inputs, piece, restrict=laid.restrict, rel=rel, bias=bias, need_lse=need_lse)
        if laid.tiling.order is not None and "order" not in self.supports:  # the permuted sequence, and back
            out, lse = in_order(self.tiled, laid.inputs, laid.tiling, restrict=laid.restrict, rel=laid.rel,
                                bias=bias, need_lse=need_lse)
        else:
            tiling, restrict = self.supported(laid.tiling, laid.restrict, laid.rel, bias)
            out, lse = self.run(laid.inputs, tiling, restrict=restrict, rel=laid.rel, bias=bias, need_lse=need_lse)
        return finish(piece, inputs, out, lse)

    def piece_run(self, piece: Piece) -> Callable | None:
        """This executor's own way of computing ``piece`` (``pieces_run``), or None: then it is laid out."""
        return next((run for kind, run in self.pieces_run if isinstance(piece, kind)), None)

    def checked(self, inputs: Inputs, piece: Piece, restrict: KeyRestrictions | None, rel: RelTerms | None,
                bias: Tensor | None) -> Laid:
        """``piece`` laid out on ``inputs``, its tiling checked against them (and the bias): what ``tiled`` runs."""
        laid = lay(piece, inputs, rel, restrict)
        if bias is not None:
            if not isinstance(bias, Tensor) or not bias.is_floating_point():
                raise ValueError(f"bias must be a floating tensor, got {getattr(bias, 'dtype', type(bias).__name__)}")
            if bias.requires_grad:
                raise ValueError("bias takes no gradient: pass it detached")
        q, k = laid.inputs.q, laid.inputs.k
        laid.tiling.check(q.shape[2], k.shape[2], laid.restrict, None if laid.rel is None else laid.rel.distances,
                          heads=tuple(q.shape[:2]))
        return laid

    def supported(self, tiling: Tiling, restrict: KeyRestrictions | None, rel: RelTerms | None,
                  bias: Tensor | None) -> tuple[Tiling, KeyRestrictions | None]:
        """A checked call's tiling and restrictions as this executor takes them (labelled pairs lowered to a tile
        mask unless it reads them); a ValueError naming what it does not support, and who does."""
        if restrict is not None and restrict.labels is not None and "labels" not in self.supports:
            tiling, restrict = labels_as_mask(tiling, restrict)
        missing = [f for f in _features(tiling, restrict, rel, bias) if f not in self.supports]
        if missing:
            others = [repr(name) for name, ex in EXECUTORS.items() if all(f in ex.supports for f in missing)]
            who = " and ".join([", ".join(others[:-1]), others[-1]] if len(others) > 1 else others)
            raise ValueError(f"the {self.name!r} executor does not support {', '.join(missing)}"
                             + (f"; {who} {'does' if len(others) == 1 else 'do'}" if others else ""))
        return tiling, restrict

    def ranges(self, inputs: Inputs, spans: Ranges, *, order: KeyOrder | None = None,
               rel_pos: RelativePositions | None = None, need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """Each query entry against its own contiguous range of keys (``ranges.Ranges``: [lo, hi), at most
        ``width`` keys, the ``merge`` entries of a query row as one softmax, the positions for relative distances),
        over the keys in ``order`` (``ranges.KeyOrder``; default as they are). An executor with its own
        ``ranges_run`` computes it there; else tiles of entries per stretch of keys, each a tile of ``tiled``
        (``ranges.range_attention``)."""
        # ranges index keys as their caller laid them: routing's probes and MoBA/NSA's selection lay them within
        # each document and pass none; ranges given as they are cannot know where a document ends
        refuse_documents(inputs, "attention over key ranges given as they are")
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


# The executors by name, filled by ``interface.py`` (the backends register there).
EXECUTORS: dict[str, Executor] = {}
