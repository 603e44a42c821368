"""The token-id check, on host tensors: the places that make batches on the host (training, evaluation, a prompt)
run it before those go to a GPU, where reading the range back would synchronise; the model's forward, on CPU
tokens, asserts the range without a host read and calls it only to name the range once the assertion failed."""

from __future__ import annotations

import torch
from torch import Tensor


def check_token_ids(tokens: Tensor, vocab_size: int) -> None:
    """A ValueError unless every id of ``tokens`` (any shape, integer) lies in [0, vocab_size). It reads the range
    back: call it on host (CPU) tensors, before they go to a GPU."""
    low, high = (int(x) for x in tokens.aminmax())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}), got values in [{low}, {high}]")


def check_model_tokens(tokens: object, vocab_size: int, name: str = "tokens") -> None:
    """A model's check of its (B, N) integer ``tokens``: shape and dtype always; the range on CPU tensors as an
    assertion without a host read (``tests/test_host_reads.py``) that turns into ``check_token_ids``'s ValueError once
    it fails. On a GPU the range is the batch maker's to check on the host (reading it back would synchronise every
    step); an id out of range trips the embedding's device-side assert."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        raise ValueError(f"{name} must be a (B, N) tensor, got {getattr(tokens, 'shape', type(tokens))}")
    if tokens.dtype not in (torch.long, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"{name} must be an integer tensor, got dtype {tokens.dtype}")
    if tokens.shape[1] == 0:
        raise ValueError(f"{name} must hold at least one position")
    if tokens.device.type == "cpu" and not torch.compiler.is_compiling():
        try:
            inside = ((tokens >= 0) & (tokens < vocab_size)).all()
            torch._assert_async(inside, f"token ids must lie in [0, {vocab_size})")
        except RuntimeError:
            try:
                check_token_ids(tokens, vocab_size)
            except ValueError as err:  # the argument named where a model takes two sequences
                raise ValueError(str(err) if name == "tokens" else f"{name}: {err}") from None
            raise
