"""Head kinds: one file per kind, each a ``HeadGroup`` (forward, decoding cache, hooks) and its ``HeadKind`` entry
(``base.py``); ``registry.py`` lists the built-in entries and takes users' own (``register_kind``)."""

from .base import HeadGroup, HeadKind, KeyStore, Warmup

__all__ = ["HeadGroup", "HeadKind", "KeyStore", "Warmup"]
