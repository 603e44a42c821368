"""Learned absolute positions: one table, or the Sparse Transformer's factorized row/column(/channel) tables."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import TransformerConfig


class PositionEmbedding(nn.Module):
    """Embedding of positions 0 … seq_len - 1, added to the token embedding.

    'absolute': one learned vector per position. 'factorized': the sum of a row and a column embedding of the
    position in a grid of width ``grid_width`` (text), or of a row, column and channel embedding for images of
    ``image_shape`` = (rows, columns, channels) in raster order. Initialised N(0, 0.125/sqrt(dim · n_emb)).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.limit = config.seq_len
        if config.positions == "absolute":
            sizes = [config.seq_len]
        elif config.image_shape is not None:
            rows, cols, channels = config.image_shape
            sizes = [rows, cols, channels]
            self.limit = max(config.seq_len, rows * cols * channels)
        else:
            sizes = [-(-config.seq_len // config.grid_width), config.grid_width]
        self.image_shape = config.image_shape if config.positions == "factorized" else None
        self.stride = config.grid_width
        self.kind = config.positions
        self.tables = nn.ParameterList(
            nn.Parameter(torch.randn(size, config.dim) * 0.125 / math.sqrt(config.dim * len(sizes))) for size in sizes
        )

    def forward(self, start: int, n: int, device: torch.device, documents: Tensor | None = None,
                since: Tensor | None = None) -> Tensor:
        """(n, dim) embedding of positions start … start + n - 1; with packed ``documents`` (B, n), numbered from 0
        in each row (start 0 only), or decoding's ``since`` (B, n), each position's document's first position,
        (B, n, dim) of each position counted from its document's start."""
        if start + n > self.limit:
            raise ValueError(f"positions up to {start + n - 1} are past the {self.kind} position table "
                             f"(seq_len = {self.limit}); use positions='relative' or 'none' for longer sequences")
        pos = torch.arange(start, start + n, device=device)
        if documents is not None:  # minus the first position of the document (a search of the sorted ids)
            pos = pos - torch.searchsorted(documents.contiguous(), documents.contiguous())
        elif since is not None:
            pos = pos - since
        if self.kind == "absolute":
            return self.tables[0][pos]
        if self.image_shape is not None:
            _, cols, channels = self.image_shape
            index = [pos // (cols * channels), pos // channels % cols, pos % channels]
        else:
            index = [pos // self.stride, pos % self.stride]
        return sum(table[i] for table, i in zip(self.tables, index, strict=True))
