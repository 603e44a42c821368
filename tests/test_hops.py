"""Four hops from the model to the executor, for every kind of head: the package frames between
``TransformerLM.forward`` and any call into ``routeformer.executors`` (nn.Module's call machinery is torch's, not
counted). Block.forward, MixedAttention.forward, the heads' forward and the mechanism's function make four."""

from __future__ import annotations

import sys

import pytest
import torch

from routeformer.attention.registry import KINDS
from routeformer.model import TransformerConfig, TransformerLM

MOST = 4


def _model(name: str) -> TransformerLM:
    base = dict(vocab_size=32, dim=32, depth=1, heads=2, seq_len=256, attention=name)
    try:
        config = TransformerConfig(**base)
    except ValueError:  # a kind without relative positions
        config = TransformerConfig(**base, positions="none")
    torch.manual_seed(0)
    return TransformerLM(config)


def _chains(model: TransformerLM, tokens: torch.Tensor, hit, *, nested_in: str | None = None,
            with_hit: bool = False) -> list[list[str]]:
    """For every call that ``hit(frame)`` accepts during ``model(tokens)``: the package frames between
    ``TransformerLM.forward`` and the call (the called frame too when ``with_hit``), outermost first. A call made
    from inside the package ``nested_in`` is left out (a custom operator's body called back through torch)."""
    found: list[list[str]] = []

    def package(frame) -> str:
        return frame.f_globals.get("__name__", "")

    def profile(frame, event, arg):
        if event != "call" or not hit(frame):
            return
        chain, f = [], frame if with_hit else frame.f_back
        while f is not None and not (f.f_code.co_name == "forward" and package(f) == "routeformer.model.transformer"):
            if f is not frame and nested_in is not None and package(f).startswith(nested_in):
                return
            if package(f).startswith("routeformer."):
                chain.append(f"{package(f)}.{f.f_code.co_qualname}")
            f = f.f_back
        if f is not None:  # under TransformerLM.forward
            found.append(chain[::-1])

    sys.setprofile(profile)
    try:
        model(tokens)
    finally:
        sys.setprofile(None)
    return found


def executor_calls(model: TransformerLM, tokens: torch.Tensor) -> list[list[str]]:
    """For every call from outside ``routeformer.executors`` into it during ``model(tokens)``: the package frames
    between ``TransformerLM.forward`` and the call, outermost first."""
    return _chains(model, tokens, lambda f: f.f_globals.get("__name__", "").startswith("routeformer.executors"),
                   nested_in="routeformer.executors")


def test_the_count_sees_every_frame() -> None:
    """The counter follows the calls: a local model reaches the executor through its block, layer, heads and the
    local function, and a deeper path would count more."""
    calls = executor_calls(_model("local"), torch.randint(0, 32, (1, 256)))
    deepest = [c for c in calls if len(c) == max(map(len, calls))]
    assert all([name.rsplit(".", 1)[-1] for name in c][:3] == ["forward"] * 3 for c in deepest)
    assert any(c[-1].endswith("local_attention") for c in deepest)


@pytest.mark.parametrize("name", list(KINDS))
def test_four_hops_from_the_model_to_the_executor(name: str) -> None:
    model = _model(name)
    model.train()
    calls = executor_calls(model, torch.randint(0, 32, (1, 256)))
    if not any(g.kind.runs_on_executor(g.options) for layer in model.config.head_groups() for g in layer):
        return  # linear and Performer heads compute their own way (only the feed-forward's activation is fused)
    attention = [c for c in calls if any(".attention." in frame for frame in c)]
    assert attention, f"{name}: no call into the executors seen"
    deepest = max(attention, key=len)
    assert len(deepest) <= MOST, f"{name}: {len(deepest)} hops: {' > '.join(deepest)}"


# Frames from TransformerLM.forward to the fused operator's autograd Function (the frame that calls torch.ops), the
# model's and the executor's together: at most 7 for every kind: Block, MixedAttention, the heads, the mechanism's
# function, the executor's one operation (Executor.tiled or .ranges: delegate, lay out and check once for every
# executor), the fused executor's run (fused_tiled / fused_ranges: the values to the kernel's arguments), the
# operator's autograd Function. (Issue 44 had 6, with the fused executor repeating the base's checks in a class of
# its own so that a check added to one had to be copied to the other; issue 59 traded that copy for this frame.)
MOST_TO_OPERATOR = 7


def operator_calls(model: TransformerLM, tokens: torch.Tensor) -> list[list[str]]:
    """For every call of a fused attention operator's autograd Function during ``model(tokens)``: the package frames
    from below ``TransformerLM.forward`` down to it, outermost first (the feed-forward's activation left out)."""
    def hit(frame) -> bool:
        return frame.f_globals.get("__name__") == "routeformer.executors.fused.op" and frame.f_code.co_name == "forward"

    return [c for c in _chains(model, tokens, hit, with_hit=True) if not any("FeedForward" in name for name in c)]


@pytest.mark.parametrize("name", list(KINDS))
def test_at_most_six_frames_from_the_model_to_the_fused_operator(name: str) -> None:
    from routeformer.executors.fused import available

    if not available():
        pytest.skip("the fused kernels are not built here")
    model = _model(name)
    model.train()
    calls = operator_calls(model, torch.randint(0, 32, (1, 256)))
    if not any(g.kind.runs_on_executor(g.options) for layer in model.config.head_groups() for g in layer):
        assert calls == []  # linear and Performer heads compute their own way
        return
    assert calls, f"{name}: no fused operator reached"
    deepest = max(calls, key=len)
    assert len(deepest) <= MOST_TO_OPERATOR, f"{name}: {len(deepest)} frames: {' > '.join(deepest)}"
