"""torch.compile trains the model: the same losses, gradients and k-means state as eager mode (slow: inductor)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import sections_in_use
from routeformer import TransformerConfig, TransformerLM

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _pinned_isa() -> None:
    """As training compiles (``pin_inductor_isa``): inductor's cache otherwise hands this process code generated for
    another ``ATEN_CPU_CAPABILITY`` (a heap corruption here after a run of the AVX2 build)."""
    from routeformer.train.parallel import pin_inductor_isa

    pin_inductor_isa()


@pytest.mark.parametrize("spec", ["local:2,routing:2", "full", "strided", "fixed", "longformer", "performer", "linear"])
def test_compiled_training_matches_eager(spec: str) -> None:
    torch.manual_seed(0)
    sections = {"local": {"window": 8}, "fixed": {"block": 16, "summary": 4},
                "longformer": {"window": 8, "global_tokens": [0, 10]}}
    positions = "absolute" if spec in ("performer", "linear") else "relative"  # they take no relative terms
    config = TransformerConfig(vocab_size=50, dim=32, depth=2, heads=4, seq_len=64, rel_clip=8, positions=positions,
                               attention=spec, options=sections_in_use(spec, sections))
    eager = TransformerLM(config).train()
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.2)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_model)]
    x = torch.randint(0, 50, (2, 64), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        losses = []
        for run, model, opt in ((eager, eager, opts[0]), (compiled, compiled_model, opts[1])):
            loss = F.cross_entropy(run(x).flatten(0, 1), x.flatten()) + model.commitment_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.after_optimizer_step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)
    for a, b in zip(eager.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for (name, a), (_, b) in zip(eager.named_buffers(), compiled_model.named_buffers(), strict=True):
        if "centroids" in name:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
