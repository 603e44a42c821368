"""One FlexAttention call in the executors' conventions: natural-log lse, zeros and ``neg_inf`` for rows that see
no key.

On CUDA (and any device FlexAttention compiles for) this is ``torch.compile(flex_attention)``: one fused kernel that
skips the key blocks the ``BlockMask`` leaves out and applies ``mask_mod`` / ``score_mod`` inside the tiles. On CPU
FlexAttention has no backward, so the call goes to the same higher-order operator's eager implementation (what
``flex_attention`` itself runs uncompiled): dense O(Nq · Nk) scores through the same ``mask_mod`` and ``score_mod``,
forward and backward. That is the correctness path the CPU tests use; it is never chosen by ``backend="auto"``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..lse import lse_dtype, neg_inf


def _structure(fn: object) -> tuple:
    """The code objects of a function and of the functions its closure holds, recursively, with the types of the
    other cells: two calls with the same structure differ only in values that dynamo guards on cleanly."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return (type(fn),)
    cells = tuple(_structure(c.cell_contents) if callable(c.cell_contents) else (type(c.cell_contents),)
                  for c in fn.__closure__ or ())
    return (code, cells)


def _distinct(target: Callable, key: tuple) -> Callable:
    """A function calling ``target`` whose code object is its own: dynamo keeps one cache per code object.

    Why: when one compiled function meets ``mask_mod``s of different closure layouts (a band after a tile), dynamo
    recompiles and, while explaining why, evaluates the old guards' closure paths on the new functions, which can
    raise IndexError (PyTorch 2.13). One code object per closure structure never recompiles across structures.
    """

    def run(*args, **kwargs):
        return target(*args, **kwargs)

    run.__code__ = run.__code__.replace(co_name=f"flex_{abs(hash(key))}")
    return run


@functools.cache
def _compiled(key: tuple) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(_distinct(flex_attention, key), dynamic=False)


def _eager(q: Tensor, k: Tensor, v: Tensor, score_mod: Callable, block_mask, scale: float,
           key: tuple) -> tuple[Tensor, Tensor]:
    """The higher-order operator's eager path (dense, differentiable on every device): private PyTorch API, used
    only where the public ``flex_attention`` refuses gradients (CPU). A torch without that API (2.6) still lets
    the public function, uncompiled, run the same operator with gradients on the CPU: that is used there."""
    try:
        from torch._higher_order_ops.utils import setup_compilation_env
        from torch.nn.attention.flex_attention import _apply_kernel_options
    except ImportError:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, return_lse=True)

    hop = _eager_hop(key)
    options = _apply_kernel_options(q, k, v, True, None, None)
    with setup_compilation_env() as backend:
        out, lse, _ = torch.compile(hop, backend=backend, fullgraph=True)(
            q, k, v, score_mod, block_mask.as_tuple(), scale, options)
    return out, lse * math.log(2.0)  # the operator's lse is in base 2


@functools.cache
def _eager_hop(key: tuple) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention_hop

    return _distinct(flex_attention_hop, key)


@functools.cache
def _aux_request() -> type | None:
    """FlexAttention's ``AuxRequest`` where the installed torch has it, else None: then the call asks for the lse
    with ``return_lse=True``, which releases before ``AuxRequest`` only know (and later ones deprecate). Decided
    once per process."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return None
    return AuxRequest


def _compiled_call(q: Tensor, k: Tensor, v: Tensor, score_mod: Callable, block_mask, scale: float,
                   key: tuple) -> tuple[Tensor, Tensor]:
    """The compiled ``flex_attention`` with its lse (natural log, as the public function returns it in either
    convention): out (B, H, Nq, D), lse (B, H, Nq)."""
    request = _aux_request()
    if request is None:
        return _compiled(key)(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, return_lse=True)
    out, aux = _compiled(key)(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              return_aux=request(lse=True))
    return out, aux.lse


def _identity(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return score


def flex_call(q: Tensor, k: Tensor, v: Tensor, *, block_mask, scale: float,
              score_mod: Callable | None = None) -> tuple[Tensor, Tensor]:
    """softmax(q·kᵀ·scale + score_mod, block_mask's mask_mod) · v with its log-sum-exp.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D) -> out (B, H, Nq, D) in q's dtype, lse (B, H, Nq) in float32 or wider
    (``lse_dtype``), natural log. A row that sees no key gets out = 0 and lse = ``neg_inf(lse.dtype)`` exactly.
    """
    score_mod = _identity if score_mod is None else score_mod
    key = _structure(score_mod) + _structure(block_mask.mask_mod)
    eager = q.device.type == "cpu"
    if eager:
        out, lse = _eager(q, k, v, score_mod, block_mask, scale, key)
    else:
        out, lse = _compiled_call(q, k, v, score_mod, block_mask, scale, key)
    lse = lse.to(lse_dtype(q.dtype))
    saw = lse > neg_inf(lse.dtype) / 2  # FlexAttention gives -inf to a row without keys
    # The compiled kernel writes 0 for such a row already (its l_i of 0 is read as 1): a (B, H, N, D) pass forward
    # and one backward saved; the eager operator's rows are set here.
    if eager:
        out = out.masked_fill(~saw[..., None], 0.0)
    return out, torch.where(saw, lse, neg_inf(lse.dtype))
