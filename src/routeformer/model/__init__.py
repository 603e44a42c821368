"""The model: TransformerConfig -> TransformerLM (mixed-head attention blocks, positions, generation caches)."""

from .config import HeadGroupSpec, TransformerConfig, local_window, parse_attention
from .tokens import check_token_ids
from .transformer import ModelCache, TransformerLM

__all__ = ["HeadGroupSpec", "ModelCache", "TransformerConfig", "TransformerLM", "check_token_ids", "local_window",
           "parse_attention"]
