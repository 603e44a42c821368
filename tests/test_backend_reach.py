"""The configured backend is the one that computes: every path (forward, prompt, decoding step) of every kind that
runs on an executor, in a model whose ``backend`` names a recording executor, reaches that executor and no
other. The built-in executors are replaced by ones that fail for the duration, so a path that re-resolves
``"auto"`` (or names ``"tiles"`` itself) fails the test instead of silently running elsewhere."""

from __future__ import annotations

import pytest
import torch

from helpers import routing_layer, sections_in_use
from routeformer import TransformerConfig, TransformerLM
from routeformer.attention import HeadGroup
from routeformer.attention.registry import KINDS
from routeformer.executors import Executor
from routeformer.executors import interface as executors
from routeformer.executors.tiles import tiled_attention

SPECS = {  # a model spec per built-in kind that runs on an executor, with the settings it needs
    "full": "full", "local": "local", "routing": "local:2,routing:2", "strided_a1": "strided_a1:2,strided_a2:2",
    "strided_a2": "strided_a1:2,strided_a2:2", "strided": "strided", "fixed_a1": "fixed_a1:2,fixed_a2:2",
    "fixed_a2": "fixed_a1:2,fixed_a2:2", "fixed": "fixed", "longformer": "longformer", "lsh": "lsh",
    "moba": "local:2,moba:2", "nsa": "nsa", "linear": "linear", "performer": "performer",
}
ABSOLUTE = {"lsh", "linear", "performer"}  # kinds without relative positions
PROBED = {"probes": 2, "balance": 0.01}  # options.routing: the default rule; the paper's rule runs too


def _refuse(name: str) -> Executor:
    def refuse(*args, **kwargs):
        raise AssertionError(f"a path reached the {name!r} executor instead of the configured one")

    return Executor(name, refuse, route_run=refuse, select_run=refuse, scan_run=refuse)


@pytest.fixture
def recording(monkeypatch) -> list[str]:
    calls: list[str] = []

    def tiled(*args, **kwargs):
        calls.append("tiled")
        return tiled_attention(*args, **kwargs)

    def scan(*args, **kwargs):  # the feature scan's kernels: recorded, then left to the PyTorch scan
        calls.append("scan")

    table = {"recording": Executor("recording", tiled, scan_run=scan), "tiles": _refuse("tiles"),
             "flex": _refuse("flex")}
    monkeypatch.setattr(executors, "EXECUTORS", table)
    return calls


def test_every_kind_on_an_executor_is_covered() -> None:
    on_executor = {name for name, kind in KINDS.items() if kind.on_executor is True or callable(kind.on_executor)}
    assert on_executor <= set(SPECS), f"add a spec for {sorted(on_executor - set(SPECS))}"


@pytest.mark.parametrize("rule", [{}, PROBED], ids=["paper", "probes"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_path_reaches_the_configured_executor(name: str, rule: dict, recording: list[str]) -> None:
    spec = SPECS[name]
    if rule and "routing" not in spec:
        pytest.skip("the routing rule matters to routing heads only")
    sections = {"local": {"window": 6}, "strided": {"stride": 5}, "fixed": {"block": 8, "summary": 2},
                "routing": {"num_clusters": 3, "window": 6, **rule},
                "longformer": {"window": 6, "dilation": 2, "global_tokens": [2]}, "moba": {"block": 16, "top_k": 2},
                "nsa": {"block": 16, "top": 2, "window": 6}}
    config = TransformerConfig(vocab_size=23, dim=32, depth=1, heads=4, seq_len=300, attention=spec, rel_clip=6,
                               grid_width=5, options=sections_in_use(spec, sections), backend="recording",
                               positions="absolute" if spec in ABSOLUTE else "relative")
    torch.manual_seed(0)
    model = TransformerLM(config).eval()
    # resolved once, when the model is built: the heads hold the executor itself, not a name to look up per call
    held = [m._executor for m in model.modules() if isinstance(m, HeadGroup) and m._executor is not None]
    assert held and all(e.name == "recording" for e in held)
    assert not any(hasattr(m, "backend") for m in model.modules())  # no names below the config
    tokens = torch.randint(0, 23, (1, 290))  # longer than the dense-tile size of probed routing (256)
    with torch.no_grad():
        model(tokens)
        assert recording, "the forward reached no executor"
        recording.clear()
        model.generate(tokens[:, :270], max_new_tokens=3, temperature=0.0)  # a prompt, then decoding steps


@pytest.mark.parametrize("probes", [1, 2])
def test_the_routing_layer_reaches_its_executor_on_every_path(probes: int, recording: list[str]) -> None:
    """``RoutingAttention`` on its own (the functional layer, with its own cache): forward, a prompt, steps."""

    torch.manual_seed(0)
    layer = routing_layer(2, 8, num_clusters=4, window=8, probes=probes, backend="recording").eval()
    q, v = torch.randn(1, 2, 300, 8), torch.randn(1, 2, 300, 8)
    with torch.no_grad():
        layer(q, q, v)
        assert recording
        recording.clear()
        cache = layer.new_cache(1, max_len=300)
        layer.decode(q[:, :, :290], q[:, :, :290], v[:, :, :290], cache)  # the prompt: one forward
        assert recording, "the prompt reached no executor"
        layer.decode(q[:, :, 290:292], q[:, :, 290:292], v[:, :, 290:292], cache)
