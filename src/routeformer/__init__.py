"""routeformer: long-sequence Transformers with content-based sparse attention."""

__version__ = "0.1.0"
