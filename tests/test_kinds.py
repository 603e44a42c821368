"""The head-kind registry: every kind passes the generic checks, users register their own, the checks can fail,
and nothing outside ``attention/`` switches on a kind's name."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import sections_in_use
from routeformer import TransformerConfig, TransformerLM
from routeformer.attention import (
    KINDS,
    HeadGroup,
    HeadKind,
    Inputs,
    LocalOptions,
    full_attention,
    get_kind,
    local_attention,
    local_mask,
    register_kind,
    unregister_kind,
)
from routeformer.testing import check_kind

# small settings of every kind (options sections), and the model fields that go with them
SMALL = {"local": {"window": 8}, "longformer": {"window": 8}, "strided": {"stride": 6},
         "fixed": {"block": 12, "summary": 3}, "routing": {"num_clusters": 4, "window": 8},
         "moba": {"block": 5, "top_k": 2}, "nsa": {"block": 5, "top": 2, "window": 6}}
SMALL_FIELDS = {"rel_clip": 8, "grid_width": 6}
BUILT_IN = ["full", "local", "routing", "strided", "strided_a1", "strided_a2", "fixed", "fixed_a1", "fixed_a2",
            "longformer", "lsh", "linear", "performer", "moba", "nsa"]
ABSOLUTE = {"positions": "absolute"}  # the kernel heads have no relative positions


def test_the_built_in_kinds_are_registered_in_order() -> None:
    assert list(KINDS)[:len(BUILT_IN)] == BUILT_IN


@pytest.mark.parametrize("name, own, extra", [  # own: settings of the kind's own options section
    *[(name, {}, {} if KINDS[name].relative_positions is not False else ABSOLUTE)  # every kind registered now
      for name in KINDS if name not in ("longformer", "linear")],
    ("linear", {"kernel": "elu"}, ABSOLUTE),
    ("full", {"kernel": "elu"}, ABSOLUTE),
    ("full", {"kernel": "poly2"}, ABSOLUTE),
    ("local", {"kernel": "elu"}, ABSOLUTE),
    ("local", {"kernel": "poly2"}, ABSOLUTE),
    ("linear", {"kernel": "poly2"}, ABSOLUTE),
    ("performer", {"features": 12, "redraw_every": 1}, ABSOLUTE),
    ("longformer", {"dilation": [1, 3], "global_tokens": [0, 7]}, {}),
    ("routing", {"shared_qk": False}, {}),
    ("routing", {"shared_qk": False, "separate": True}, {}),
    ("moba", {"warmup": 1}, {}),
    ("nsa", {"warmup": 1}, {}),
])
def test_every_built_in_kind_passes_the_generic_checks(name: str, own: dict, extra: dict) -> None:
    section = KINDS[name].options_key
    options = sections_in_use(name, {**SMALL, section: {**SMALL.get(section, {}), **own}})
    report = check_kind(name, seq_len=40, options=options, **SMALL_FIELDS, **extra)
    assert max(report.reference, report.reference_grad, report.leak, report.decode) <= 1e-9


@dataclass(frozen=True)
class BandOptions:
    width: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.width, int) or self.width < 1:
            raise ValueError(f"width must be a positive integer, got {self.width!r}")


class BandHeads(HeadGroup):
    """The last ``width`` positions, by the package's local attention; ``leak``/``skew``/``forget`` break it."""

    def __init__(self, heads: int, head_dim: int, width: int, fault: str | None = None) -> None:
        super().__init__(heads, head_dim)
        self.width, self.fault = width, fault

    def forward(self, q, k, v, rel_pos):
        if self.fault == "leak":  # sees the future
            return local_attention(Inputs.of(q, k, v), LocalOptions(self.width), causal=False, rel=rel_pos)
        if self.fault == "skew":  # a different pattern than its mask says
            return full_attention(Inputs.of(q, k, v), causal=True, rel=rel_pos)
        return local_attention(Inputs.of(q, k, v), LocalOptions(self.width), causal=True, rel=rel_pos)

    def reference_mask(self, q, k):  # "leak" describes itself truly: only the leak check can catch it
        return local_mask(q.shape[2], self.width, causal=self.fault != "leak", device=q.device)

    def step(self, q, cache, t, rel_pos):
        keys, values, positions = cache.filled()  # every position is kept
        allowed = None if self.fault == "forget" else positions > t - self.width  # "forget": attends to all
        return self.attend(q, keys, values, positions, t, rel_pos, allowed=allowed)


def _register(name: str, fault: str | None = None) -> HeadKind:
    return register_kind(HeadKind(name, lambda o, heads, head_dim, seed: BandHeads(heads, head_dim, o.width, fault),
                                  keys_per_query=lambda o, n: min(o.width, n), option_type=BandOptions), replace=True)


@pytest.fixture
def band():
    yield _register("band")
    unregister_kind("band")


def test_a_user_kind_trains_decodes_and_passes_the_checks(band) -> None:
    config = TransformerConfig(vocab_size=32, dim=32, depth=2, heads=4, seq_len=32, rel_clip=8,
                               attention="local:2,band:2", options={"local": {"window": 8}, "band": {"width": 3}})
    assert config.keys_per_query() == {"local": 8, "band": 3}
    model = TransformerLM(config)
    assert [type(g).__name__ for g in model.head_groups()] == ["LocalHeads", "BandHeads"] * 2
    assert model.head_groups()[1].width == 3
    out = model.generate(torch.zeros(1, 4, dtype=torch.long), 6, temperature=0)
    assert out.shape == (1, 10)
    assert TransformerConfig.from_dict(config.to_dict()) == config
    check_kind("band", options={"band": {"width": 5}})


@pytest.mark.parametrize("fault, check", [("leak", "leak"), ("skew", "reference"), ("forget", "decode")])
def test_the_generic_checks_catch_a_broken_kind(fault: str, check: str) -> None:
    _register("broken", fault)
    try:
        with pytest.raises(AssertionError, match=f"broken heads fail the {check} check"):
            report = check_kind("broken")
            pytest.fail(f"no check failed: {report}")
    finally:
        unregister_kind("broken")


@pytest.mark.parametrize("kwargs, message", [
    ({"options": {"band": {"widht": 3}}}, r"options.band: unknown field\(s\) \['widht'\]; band heads take width"),
    ({"options": {"band": {"width": 0}}}, r"options.band: width must be a positive integer"),
    ({"options": {"local": {"window": 64}}}, r"options.local: window \(64\) is larger than seq_len \(32\)"),
    ({"options": {"nope": {}}}, r"options: unknown section\(s\) \['nope'\]; the registered kinds read full, .*band"),
    ({"options": {"band": 3}}, r"options.band must be a table of field = value"),
])
def test_kind_options_are_checked_by_name(band, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        options = {"local": {"window": 8}, **kwargs["options"]}
        TransformerConfig(heads=2, dim=16, seq_len=32, attention="local:1,band:1", options=options)


def test_registering_needs_a_fresh_valid_name(band) -> None:
    with pytest.raises(ValueError, match="'band' is already registered; pass replace=True"):
        register_kind(get_kind("band"))
    with pytest.raises(ValueError, match="letters, digits and '_'"):
        register_kind(HeadKind("my-kind", get_kind("band").build, keys_per_query=lambda o, n: 1))
    with pytest.raises(ValueError, match="unknown mechanism 'gone'; allowed: full, local, routing"):
        get_kind("gone")


def test_a_kind_without_relative_positions_says_so(band) -> None:
    register_kind(HeadKind("absolute_only", get_kind("band").build, keys_per_query=lambda o, n: 1,
                           option_type=BandOptions, relative_positions=False))
    try:
        with pytest.raises(ValueError, match="absolute_only heads do not support relative positions"):
            TransformerConfig(heads=2, dim=16, seq_len=32, rel_clip=8, attention="absolute_only")
        TransformerConfig(heads=2, dim=16, seq_len=32, rel_clip=8, attention="absolute_only", positions="none")
    finally:
        unregister_kind("absolute_only")


def _names_compared_outside_attention() -> list[str]:
    """Places outside attention/ whose code compares or looks up a built-in kind's name."""
    src = Path(__file__).resolve().parents[1] / "src" / "routeformer"
    found = []
    for path in sorted(src.rglob("*.py")):
        if "attention" in path.relative_to(src).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            operands = []
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.Subscript):
                operands = [node.slice]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("startswith", "uses"):
                operands = list(node.args)
            for op in operands:
                if isinstance(op, ast.Constant) and op.value in BUILT_IN:
                    found.append(f"{path.relative_to(src)}:{node.lineno}: {op.value!r}")
    return found


def test_no_module_outside_attention_switches_on_a_kind_name() -> None:
    assert _names_compared_outside_attention() == []
