"""The fixed attention patterns by name, each a fast function paired with its mask.

The tests iterate over ``PATTERNS`` (holding each function to ``reference_attention`` under its mask), and a CLI test
checks that the attention benchmark reports every name here; the model and the benchmarks choose their attention
functions themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .fixed import fixed_attention
from .full import full_attention
from .local import local_attention
from .longformer import longformer_attention
from .masks import fixed_mask, full_mask, local_mask, longformer_mask, strided_mask
from .strided import strided_attention


@dataclass(frozen=True)
class Pattern:
    """A fixed sparsity pattern: its fast function and its mask builder, which take the same parameters.

    ``attend(q, k, v, **params, causal=..., key_padding_mask=..., rel_pos=...)`` and
    ``mask(n, **params, causal=..., heads=...)`` describe the same attention; the tests hold the first to
    ``reference_attention`` fed with the second.
    """

    name: str
    attend: Callable
    mask: Callable

    def build_mask(self, n: int, heads: int, causal: bool, **params):
        """(H, N, N) mask of this pattern (every mask builder returns one when given ``heads``)."""
        return self.mask(n, causal=causal, heads=heads, **params)


PATTERNS: dict[str, Pattern] = {
    p.name: p
    for p in [
        Pattern("full", full_attention, full_mask),
        Pattern("local", local_attention, local_mask),
        Pattern("strided", strided_attention, strided_mask),
        Pattern("fixed", fixed_attention, fixed_mask),
        Pattern("longformer", longformer_attention, longformer_mask),
    ]
}


def get_pattern(name: str) -> Pattern:
    """The pattern called ``name``; a ValueError lists the known names otherwise."""
    try:
        return PATTERNS[name]
    except KeyError:
        raise ValueError(f"unknown attention pattern {name!r}; known: {', '.join(PATTERNS)}") from None
