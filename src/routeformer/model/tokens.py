"""The token-id check, on host tensors: the places that make batches on the host (training, evaluation, a prompt)
run it before those go to a GPU, where reading the range back would synchronise; the model's forward, on CPU
tokens, asserts the range without a host read and calls it only to name the range once the assertion failed."""

from __future__ import annotations

from torch import Tensor


def check_token_ids(tokens: Tensor, vocab_size: int) -> None:
    """A ValueError unless every id of ``tokens`` (any shape, integer) lies in [0, vocab_size). It reads the range
    back: call it on host (CPU) tensors, before they go to a GPU."""
    low, high = (int(x) for x in tokens.aminmax())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}), got values in [{low}, {high}]")
