"""What every head kind is made of (``base.py``): a ``HeadGroup`` (forward, decoding cache, hooks) and its
``HeadKind`` registry entry, and the helpers kinds share (``common.py``). Each built-in kind lives in its
mechanism's own module (``attention/local.py``, ``attention/routing/kind.py``, …); ``registry.py`` lists the
built-in entries and takes users' own (``register_kind``)."""

from .base import HeadGroup, HeadKind, KeyStore, Warmup

__all__ = ["HeadGroup", "HeadKind", "KeyStore", "Warmup"]
