"""The model: TransformerConfig -> TransformerLM (mixed-head attention blocks, positions, generation caches)."""

from .config import HeadGroupSpec, TransformerConfig, parse_attention
from .transformer import ModelCache, TransformerLM, check_token_ids

__all__ = ["HeadGroupSpec", "ModelCache", "TransformerConfig", "TransformerLM", "check_token_ids", "parse_attention"]
