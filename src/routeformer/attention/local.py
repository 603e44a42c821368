"""Local (sliding-window) attention, computed in blocks of ``window``."""

from __future__ import annotations

from torch import Tensor

from .checks import positive_int
from .executors import Backend, get_executor
from .inputs import check_inputs
from .kernels import check_kernel, check_kernel_backend, kernel_attention
from .relative import RelativePositions


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    causal: bool = True,
    scale: float | None = None,
    rel_pos: RelativePositions | None = None,
    *,
    key_padding_mask: Tensor | None = None,
    kernel: str = "exp",
    backend: Backend = "auto",
) -> Tensor:
    """Sliding-window attention: causal, query i sees i - window < j <= i; non-causal, |i - j| < window.

    ``kernel``: 'exp' (softmax), or 'poly2' / 'elu' (``kernels.kernel_attention``, blocks of 256 queries; no
    relative positions; one implementation: ``backend`` "flex" is refused). ``backend``: the executor
    (``"auto"``: FlexAttention on CUDA, tiles elsewhere; ``"tiles"``; ``"flex"``).

    q, k, v: (B, H, N, D) -> (B, H, N, D). The sequence is cut into blocks of ``window`` queries (half a window
    from 128 up); each block attends to its own keys and those of the blocks before it that the window reaches
    (and after it when non-causal) under a static mask. O(N · window · D) time, O(N · window) memory, relative
    positions included; any N.
    """
    if check_kernel("kernel", kernel) != "exp":
        check_kernel_backend(kernel, backend)
        return kernel_attention(q, k, v, kernel, causal, scale, window=positive_int("window", window),
                                key_padding_mask=key_padding_mask, rel_pos=rel_pos)
    _, _, _, _, scale, key_valid = check_inputs(q, k, v, scale, key_padding_mask, rel_pos)
    window = positive_int("window", window)
    out, _ = get_executor(backend, q.device).band(q, k, v, window=window, causal=causal, scale=scale,
                                                  key_valid=key_valid, rel_pos=rel_pos)
    return out
