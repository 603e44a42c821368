"""Executors by name: how the pieces the patterns are built from are computed.

A pattern (``local``, ``strided``, ``fixed``, ``longformer``, ``full``, ``routing``) says which keys each query
sees and builds that from a few pieces; an executor computes the pieces without an N×N matrix. Every pattern
function takes ``backend`` (as do the head modules and ``TransformerConfig``) and calls
``get_executor(backend, q.device)``:

- ``"tiles"`` (``tiles/``): blocked PyTorch with a fused custom operator; runs everywhere, the default off CUDA.
- ``"flex"`` (``flex/``): FlexAttention, compiled, one fused kernel per piece with a block-sparse ``BlockMask``;
  the default on CUDA. On CPU it runs FlexAttention's dense eager operator (correctness tests only).
- ``"auto"``: ``"flex"`` on CUDA, ``"tiles"`` elsewhere.

``register_executor`` adds another by name. Every operation takes (B, H, N, D) queries, keys and values and
returns ``(out, lse)``: out (B, H, N, D), zeros for a row that sees no key, and lse (B, H, N) or None
(``need_lse=False``), in float32 or wider, exactly ``neg_inf(lse.dtype)`` for a row that sees no key;
``merge_partials`` combines parts over disjoint key sets exactly on that convention. Routing's key restrictions
(groups, the query's own key, original positions) travel as one ``KeyRestrictions`` argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import flex
from .ranges import range_attention
from .relative import RelativePositions
from .tiles import KeyRestrictions, band_attention, lse_dtype, merge_partials, neg_inf, saw_key, tiled_attention

OPERATIONS = ("tiled", "band")


@dataclass(frozen=True)
class Executor:
    """The two operations an executor provides, with the signatures and results of the tiled executor's functions,
    and the pieces built from them (the same for every executor).

    tiled: ``tiled_attention`` (query blocks against spans of neighbouring key blocks under a tile mask; one dense
        tile when block >= N), O(N · S · D) for spans of S keys.
    band: ``band_attention`` (sliding window over the sequence order), O(N · window · D).
    """

    name: str
    tiled: Callable
    band: Callable

    def block_diagonal(self, q: Tensor, k: Tensor, v: Tensor, block: int, *, causal: bool, scale: float,
                       key_valid: Tensor | None, rel_pos: RelativePositions | None,
                       need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attention within blocks of ``block`` positions (j <= i too when causal); block >= N is one dense tile.

        q, k, v: (B, H, N, D) -> out (B, H, N, D), lse (B, H, N) or None. Time O(N · block · D), memory
        O(N · block).
        """
        size = min(block, q.shape[2])
        allow = torch.ones(size, size, dtype=torch.bool, device=q.device).tril() if causal else None
        return self.tiled(q, k, v, block=size, allow=allow, scale=scale, key_valid=key_valid, rel_pos=rel_pos,
                          rel_unit=1, need_lse=need_lse)

    def subset(self, q: Tensor, k: Tensor, v: Tensor, key_idx: Tensor, allow: Tensor | None, *, scale: float,
               key_valid: Tensor | None, rel_pos: RelativePositions | None,
               need_lse: bool = False) -> tuple[Tensor, Tensor | None]:
        """Every query against the keys at positions ``key_idx`` (M,) only, under ``allow`` (N, M) (rows may be
        empty).

        q, k, v: (B, H, N, D); key_valid (B, 1 or H, N) -> out (B, H, N, D) (zeros where a row sees nothing), lse
        (B, H, N) or None. One dense (N, M) tile of the gathered keys: time O(N · M · D), memory O(N · M);
        relative distances key_idx[m] - i, by gathers.
        """
        N = q.shape[2]
        delta = None if rel_pos is None else key_idx[None, :] - torch.arange(N, device=q.device)[:, None]
        return self.tiled(
            q, k[:, :, key_idx], v[:, :, key_idx], block=N, allow=allow, scale=scale,
            key_valid=None if key_valid is None else key_valid[:, :, key_idx], rel_pos=rel_pos, rel_delta=delta,
            empty_rows=True, need_lse=need_lse,
        )

    def ranges(self, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, *, width: int, scale: float,
               merge: int = 1, **options) -> tuple[Tensor, Tensor | None]:
        """Each query entry against its own contiguous range of keys [lo, hi) (at most ``width`` keys), the
        ``merge`` entries of a query row as one softmax: tiles of entries per stretch of keys, each a tile of
        ``tiled`` (``ranges.range_attention``, which documents the options: key order, validity, positions for
        relative distances)."""
        return range_attention(self, q, k, v, lo, hi, width=width, scale=scale, merge=merge, **options)


EXECUTORS: dict[str, Executor] = {
    "tiles": Executor("tiles", tiled_attention, band_attention),
    "flex": Executor("flex", flex.tiled, flex.band),
}


Backend = str | Executor  # a registered executor's name, "auto", or an executor resolved already


def check_backend(name: Backend) -> Backend:
    """``name`` if it is an executor, ``"auto"`` or a registered executor's name; a ValueError lists the choices
    otherwise."""
    if not isinstance(name, Executor) and name != "auto" and name not in EXECUTORS:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(EXECUTORS)}")
    return name


def resolve_backend(name: Backend, device: torch.device | str | None) -> str:
    """The executor ``name`` stands for on ``device``: ``"auto"`` is ``"flex"`` on CUDA, ``"tiles"`` elsewhere."""
    if isinstance(name, Executor):
        return resolve_backend(name.name, device) if name.name == "auto" else name.name
    if check_backend(name) != "auto":
        return name
    return "flex" if torch.device(device or "cpu").type == "cuda" else "tiles"


def get_executor(backend: Backend = "auto", device: torch.device | str | None = None) -> Executor:
    """The executor ``backend`` is on ``device``: an executor as it is, a name looked up (see ``resolve_backend``)."""
    if isinstance(backend, Executor):
        return backend
    return EXECUTORS[resolve_backend(backend, device)]


def executor_for(backend: Backend) -> Executor:
    """``backend`` resolved once, for a module to keep and hand on: a named executor, or for ``"auto"`` the one
    executor whose operations take the registered executor of their queries' device (``resolve_backend``)."""
    if isinstance(backend, Executor):
        return backend
    return AUTO if check_backend(backend) == "auto" else EXECUTORS[backend]


def _on_device(operation: str) -> Callable:
    def run(q: Tensor, *args, **kwargs):
        return getattr(EXECUTORS[resolve_backend("auto", q.device)], operation)(q, *args, **kwargs)

    run.__name__ = f"auto_{operation}"
    return run


AUTO = Executor("auto", _on_device("tiled"), _on_device("band"))


def register_executor(name: str, executor: Executor, *, replace: bool = False) -> None:
    """Make ``executor`` available as ``name``; an existing name is replaced only with ``replace=True``."""
    if name in EXECUTORS and not replace:
        raise ValueError(f"attention executor {name!r} is already registered; pass replace=True to replace it")
    missing = [op for op in OPERATIONS if not callable(getattr(executor, op, None))]
    if missing:
        raise ValueError(f"attention executor {name!r} lacks the operations {', '.join(missing)}")
    EXECUTORS[name] = executor


__all__ = [
    "AUTO",
    "EXECUTORS",
    "OPERATIONS",
    "Executor",
    "Backend",
    "check_backend",
    "executor_for",
    "KeyRestrictions",
    "get_executor",
    "lse_dtype",
    "merge_partials",
    "neg_inf",
    "register_executor",
    "resolve_backend",
    "saw_key",
]
