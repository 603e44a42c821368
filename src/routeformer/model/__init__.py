"""The model: TransformerConfig -> TransformerLM (mixed-head attention blocks, positions, generation caches)."""

from .config import HeadGroupSpec, TransformerConfig, parse_attention
from .transformer import ModelCache, TransformerLM

__all__ = ["HeadGroupSpec", "ModelCache", "TransformerConfig", "TransformerLM", "parse_attention"]
