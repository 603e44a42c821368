"""A value the code derives in one way lives in one function: the √N default (``lengths.sqrt_len``) and the local
window's fan-out to the band kinds and rel_clip (``model.local_window``). A second copy that drifts is how a
benchmark ends up measuring another model than the one it names."""

from __future__ import annotations

import re
from pathlib import Path

import routeformer
from routeformer.model import TransformerConfig, local_window

ROOT = Path(routeformer.__file__).parent
SQRT = re.compile(r"round\([^()]*(math\.sqrt\(|\*\* ?0\.5)")  # in code, not in a docstring
# MoBA's default block is another rule, 2√N / top (attention/blocks.py: the block that gives routing's cost)
OTHER_RULES = {"attention/blocks.py"}
FAN_OUT = re.compile(r"""options\.longformer\.window|["']longformer["']: \{["']window""")


def _written(pattern: re.Pattern, allowed: set[str]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{i}" for path in sorted(ROOT.rglob("*.py"))
            if str(path.relative_to(ROOT)) not in allowed
            for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]


def test_the_sqrt_default_is_written_once() -> None:
    assert _written(SQRT, {"lengths.py"} | OTHER_RULES) == []


def test_the_window_fan_out_is_written_once() -> None:
    assert _written(FAN_OUT, {"model/config.py", "model/legacy.py"}) == []


def test_the_checks_see_a_copy() -> None:
    assert SQRT.search("k = max(1, round(math.sqrt(n)))") and SQRT.search("k = round(seq_len ** 0.5)")
    assert FAN_OUT.search('sets += [f"options.longformer.window={w}"]')
    assert FAN_OUT.search('options={"longformer": {"window": 8}}')


def test_the_local_window_sets_every_band_kind_and_the_clip() -> None:
    config = TransformerConfig(heads=2, seq_len=256, attention="local:1,longformer:1", **local_window(48))
    assert config.options["local"].window == 48 and config.options["longformer"].window == 48
    assert config.rel_clip == 48
    kept = TransformerConfig(heads=2, seq_len=256, attention="local:2", rel_clip=7,
                             **local_window(48, rel_clip=False))
    assert kept.rel_clip == 7 and kept.options["local"].window == 48
