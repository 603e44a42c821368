"""Option checks the built-in kinds share: every error names the option."""

from __future__ import annotations

from typing import Any


def exp_kernel(options: Any) -> bool:
    """Heads with a ``kernel`` option (full, local) run the softmax patterns, and so take relative positions and
    an executor, only with the exponential kernel."""
    return options.kernel == "exp"


def at_most_seq_len(field: str, value: int, config: Any) -> int:
    """``value`` of the option ``field``, which cannot exceed the model's seq_len."""
    if value > config.seq_len:
        raise ValueError(f"{field} ({value}) is larger than seq_len ({config.seq_len}); use at most {config.seq_len}")
    return value


def non_negative_int(field: str, value: object) -> int:
    """``value`` if it is an integer >= 0 (bools rejected), else an error naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field} must be a non-negative integer, got {value!r}")
    return value


def boolean(field: str, value: object) -> bool:
    """``value`` if it is a bool, else an error naming ``field``."""
    if not isinstance(value, bool):
        raise ValueError(f"{field} must be true or false, got {value!r}")
    return value
