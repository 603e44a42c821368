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
key subsets and grid columns are pieces ``tiled`` takes in place of a tiling (``pieces.py``), laid out the same for
every executor; ranges are built on ``tiled`` (``base.Executor.ranges``). The class ``Executor`` and the registry
``EXECUTORS`` live in ``base.py``, which the backends may import; this module fills the registry.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import flex
from .base import EXECUTORS, FEATURES, Executor
from .fused import executor as fused
from .fused.op import sigmoid_gelu
from .fused.probes import fused_probe_ranges
from .fused.routes import fused_route
from .fused.scan import fused_feature_scan
from .fused.selection import fused_select_blocks
from .fused.vectors import fused_routing_vectors
from .pieces import SortedWindow
from .tiles import tiled_attention


def _unless_fused_takes(q: Tensor) -> Executor | None:
    """The fused executor's delegate: the tiles executor for queries its kernels do not take (off the CPU, half
    dtypes, or no kernels: a warning said why, once)."""
    return None if fused.takes(q) else EXECUTORS["tiles"]


EXECUTORS.update({
    # LSH's labelled pairs run in its own rounds operator there; a tiling's labels are lowered to a tile mask
    "fused": Executor("fused", fused.fused_tiled, supports=frozenset(FEATURES) - {"labels"},
                      ranges_run=fused.fused_ranges, rounds_run=fused.fused_rounds, delegate=_unless_fused_takes,
                      route_run=fused_route, select_run=fused_select_blocks, scan_run=fused_feature_scan,
                      probes_run=fused_probe_ranges, vectors_run=fused_routing_vectors,
                      activation_run=sigmoid_gelu),
    "tiles": Executor("tiles", tiled_attention),
    # routing's sorted window from its intervals (block tables a few key blocks wide)
    "flex": Executor("flex", flex.tiled, ranges_run=flex.flex_ranges,
                     pieces_run=((SortedWindow, flex.sorted_window),), route_run=flex.flex_route,
                     select_run=flex.flex_select_blocks),
})


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
    """The executor ``backend`` is on ``device``: an executor as it is, a name looked up (see ``resolve_backend``).
    What the device alone settles is settled here: "fused" off the CPU is the tiles executor (its kernels run on
    the CPU only; ``describe_backend`` says so), so that no call asks again. The rest (a dtype the kernels do not
    take, kernels that failed to build) is asked once per call, by ``Executor.runner``."""
    if isinstance(backend, Executor):
        return backend
    name = resolve_backend(backend, device)
    if name == "fused" and torch.device(device or "cpu").type != "cpu":
        return EXECUTORS["tiles"]
    return EXECUTORS[name]


def register_executor(name: str, executor: Executor, *, replace: bool = False) -> None:
    """Make ``executor`` available as ``name``; an existing name is replaced only with ``replace=True``."""
    if name in EXECUTORS and not replace:
        raise ValueError(f"attention executor {name!r} is already registered; pass replace=True to replace it")
    if not isinstance(executor, Executor):  # an Executor has a callable run (Executor.__post_init__)
        raise ValueError(f"attention executor {name!r} must be an Executor, got {type(executor).__name__}")
    unknown = sorted(set(executor.supports) - set(FEATURES))
    if unknown:
        raise ValueError(f"attention executor {name!r} names unknown features {unknown}; known: {', '.join(FEATURES)}")
    EXECUTORS[name] = executor
