"""What the project asks of the installed torch, feature-detected rather than read from its version: FlexAttention's
lse with or without ``AuxRequest`` (torch 2.6 has only ``return_lse``), its CPU path without the private helpers
of later releases."""

from __future__ import annotations

import pytest
import torch

from routeformer.executors.flex import call


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile", "ignore:return_lse is deprecated")
@pytest.mark.parametrize("aux", [True, False], ids=["AuxRequest", "return_lse"])
def test_the_compiled_flex_call_reads_the_lse_with_or_without_aux_request(monkeypatch, aux: bool) -> None:
    """The CUDA path's call (``_compiled_call``), run on CPU through the public, uncompiled ``flex_attention``
    (forward only), against a dense float64 softmax: the same out and natural-log lse whichever way it asks."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not aux:
        monkeypatch.setattr(call, "_aux_request", lambda: None)  # as on a torch without AuxRequest
    elif call._aux_request() is None:
        pytest.skip(f"torch {torch.__version__} has no AuxRequest")
    asked = []

    def uncompiled(key):
        def run(*args, **kwargs):
            asked.append(sorted(name for name in kwargs if name.startswith("return_")))
            return flex_attention(*args, **kwargs)

        return run

    monkeypatch.setattr(call, "_compiled", uncompiled)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 40, 40, device="cpu")
    with torch.no_grad():
        out, lse = call._compiled_call(q, k, v, call._identity, mask, 0.3, ())
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
    assert asked == [["return_aux"] if aux else ["return_lse"]]
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)


def _dense(q, k, v, scale: float):
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
                                                           .tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile", "ignore:return_lse is deprecated")
def test_the_cpu_flex_call_without_the_private_helpers_uses_the_public_function(monkeypatch) -> None:
    """Where ``setup_compilation_env`` is missing (torch 2.6), the CPU path runs the public ``flex_attention``
    uncompiled: the same out and natural-log lse (forward only here: this torch's public function refuses CPU
    gradients; torch 2.6's gives them, which its run of the suite checks)."""
    import torch._higher_order_ops.utils as utils
    from torch.nn.attention.flex_attention import create_block_mask

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 40, 40, device="cpu")
    want_out, want_lse = _dense(q, k, v, 0.3)
    if hasattr(utils, "setup_compilation_env"):
        monkeypatch.delattr(utils, "setup_compilation_env")
    with torch.no_grad():
        out, lse = call._eager(q, k, v, call._identity, mask, 0.3, ())
    torch.testing.assert_close(lse.double(), want_lse)
    torch.testing.assert_close(out, want_out)
