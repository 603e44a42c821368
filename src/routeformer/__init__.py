"""routeformer: long-sequence Transformers with content-based sparse attention."""

from .model import TransformerConfig, TransformerLM

__version__ = "0.1.0"
__all__ = ["TransformerConfig", "TransformerLM", "__version__"]
