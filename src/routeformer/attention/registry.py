"""The one registry of attention: head kinds for models (``KINDS``) and the functional fixed patterns (``PATTERNS``).

``KINDS`` maps each name ``TransformerConfig.attention`` accepts to its ``HeadKind`` (how to build the heads, their
options, cost, decoding cache and hooks: see ``kinds/base.py``). The built-in kinds come from their mechanisms'
modules (``full.py``, ``local.py``, ``routing/kind.py``, …), one entry each below; ``register_kind`` adds a user's
own. Nothing outside ``attention/`` switches on a kind's name.

``PATTERNS`` pairs each fixed pattern's fast function with its mask builder: the tests hold the first to
``reference_attention`` under the second, and the attention benchmark reports every name here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from ..executors import Backend
from ..executors.inputs import Inputs
from ..executors.relative import RelativePositions
from . import fixed, full, linear, local, longformer, lsh, moba, nsa, performer, strided
from .kinds.base import HeadKind
from .routing import kind as routing

KINDS: dict[str, HeadKind] = {}


def register_kind(kind: HeadKind, *, replace: bool = False) -> HeadKind:
    """Make ``kind`` usable by name in ``TransformerConfig.attention``; returns it. A name that is taken is an
    error unless ``replace`` (for re-running a notebook cell); names are letters, digits and '_'."""
    if not isinstance(kind, HeadKind):
        raise ValueError(f"register_kind takes a HeadKind, got {type(kind).__name__}")
    if not kind.name or not kind.name.replace("_", "").isalnum():
        raise ValueError(f"a head kind's name must be letters, digits and '_' (it appears in attention specs such "
                         f"as 'local:4,{kind.name or 'name'}:4'), got {kind.name!r}")
    if kind.name in KINDS and not replace:
        raise ValueError(f"head kind {kind.name!r} is already registered; pass replace=True to redefine it")
    KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    """Remove a kind registered by ``register_kind`` (tests; models built with it keep working)."""
    get_kind(name)
    del KINDS[name]


def get_kind(name: str) -> HeadKind:
    """The head kind called ``name``; a ValueError lists the known names otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown mechanism {name!r}; allowed: {', '.join(KINDS)}") from None


# The built-in kinds, in the order error messages list them. A new built-in mechanism is one module (its function,
# mask, head kind and options) and one entry here.
for _kind in (full.KIND, local.KIND, routing.KIND, *strided.KINDS, *fixed.KINDS, longformer.KIND, lsh.KIND,
              linear.KIND, performer.KIND, moba.KIND, nsa.KIND):
    register_kind(_kind)


def default_attention(heads: int) -> str:
    """The default head mix: half local, half routing (all local with one head)."""
    half = heads // 2
    return f"local:{heads - half},routing:{half}" if half else "local"


@dataclass(frozen=True)
class Pattern:
    """A fixed sparsity pattern: its fast function, its mask builder and its options type.

    ``mask(n, **params, causal=..., heads=...)`` and ``run(inputs, executor, causal=..., rel=..., **params)`` (the
    fast function under ``options(**params)``) describe the same attention; the tests hold the second to
    ``reference_attention`` under the first.
    """

    name: str
    attend: Callable  # attend(inputs, options, executor, *, causal, rel[, merged])
    mask: Callable
    options: type

    def run(self, inputs: Inputs, executor: Backend = "auto", *, causal: bool = True,
            rel: RelativePositions | None = None, **params) -> Tensor:
        """The fast function on ``inputs`` (B, H, N, D) under the mask builder's ``params``: those of the options
        type make its options, ``merged`` (strided, fixed) is passed on."""
        merged = {"merged": params.pop("merged")} if "merged" in params else {}
        return self.attend(inputs, self.options(**params), executor, causal=causal, rel=rel, **merged)

    def build_mask(self, n: int, heads: int, causal: bool, **params):
        """(H, N, N) mask of this pattern (every mask builder returns one when given ``heads``)."""
        return self.mask(n, causal=causal, heads=heads, **params)


PATTERNS: dict[str, Pattern] = {
    p.name: p
    for p in [
        Pattern("full", full.full_attention, full.full_mask, full.KernelOptions),
        Pattern("local", local.local_attention, local.local_mask, local.LocalOptions),
        Pattern("strided", strided.strided_attention, strided.strided_mask, strided.StridedOptions),
        Pattern("fixed", fixed.fixed_attention, fixed.fixed_mask, fixed.FixedOptions),
        Pattern("longformer", longformer.longformer_attention, longformer.longformer_mask,
                longformer.LongformerOptions),
    ]
}


def get_pattern(name: str) -> Pattern:
    """The pattern called ``name``; a ValueError lists the known names otherwise."""
    try:
        return PATTERNS[name]
    except KeyError:
        raise ValueError(f"unknown attention pattern {name!r}; known: {', '.join(PATTERNS)}") from None
