"""Option checks the built-in kinds share: every error names the config field."""

from __future__ import annotations

from typing import Any


def exp_kernel(options: Any) -> bool:
    """Heads with a ``kernel`` option (full, local) run the softmax patterns, and so take relative positions and
    an executor, only with the exponential kernel."""
    return options.kernel == "exp"


def within_seq_len(config: Any, field: str, kind: str) -> int:
    """``config.<field>``, which ``kind`` heads cannot take larger than seq_len."""
    value = getattr(config, field)
    if value > config.seq_len:
        raise ValueError(f"{field} ({value}) is larger than seq_len ({config.seq_len}), which {kind} heads do not "
                         f"allow; use at most {config.seq_len}")
    return value
