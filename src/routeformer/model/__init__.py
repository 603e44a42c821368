"""The model: TransformerConfig -> TransformerLM (mixed-head attention blocks, positions, generation caches)."""

from .config import MECHANISMS, TransformerConfig, parse_attention
from .transformer import ModelCache, TransformerLM

__all__ = ["MECHANISMS", "ModelCache", "TransformerConfig", "TransformerLM", "parse_attention"]
