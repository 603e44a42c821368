"""Attention patterns by name: what the model's ``attention`` spec, the benchmarks and the tests iterate over."""

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
    """A fixed sparsity pattern: its fast function, its mask builder and the parameters both take.

    ``attend(q, k, v, **params, causal=..., key_padding_mask=..., rel_pos=...)`` and
    ``mask(n, **params, causal=..., heads=...)`` describe the same attention; the tests hold the first to
    ``reference_attention`` fed with the second.
    """

    name: str
    attend: Callable
    mask: Callable
    params: tuple[str, ...]
    split_heads: bool = False  # True when `merged=False` gives different heads different sets

    def build_mask(self, n: int, heads: int, causal: bool, **params):
        """(H, N, N) mask of this pattern."""
        mask = self.mask(n, causal=causal, heads=heads, **params)
        return mask if mask.dim() == 3 else mask.expand(heads, n, n)


PATTERNS: dict[str, Pattern] = {
    p.name: p
    for p in [
        Pattern("full", full_attention, full_mask, ()),
        Pattern("local", local_attention, local_mask, ("window",)),
        Pattern("strided", strided_attention, strided_mask, ("stride", "merged"), split_heads=True),
        Pattern("fixed", fixed_attention, fixed_mask, ("block", "summary", "merged"), split_heads=True),
        Pattern("longformer", longformer_attention, longformer_mask, ("window", "dilation", "global_tokens")),
    ]
}


def get_pattern(name: str) -> Pattern:
    """The pattern called ``name``; a ValueError lists the known names otherwise."""
    try:
        return PATTERNS[name]
    except KeyError:
        raise ValueError(f"unknown attention pattern {name!r}; known: {', '.join(PATTERNS)}") from None
