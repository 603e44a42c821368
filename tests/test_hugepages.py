"""Large CPU tensors on huge pages: the command line asks PyTorch for them (THP_MEM_ALLOC_ENABLE) before its first
tensor unless the user chose, and `routeformer env` says whether they are in effect."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from routeformer import hugepages


def test_request_sets_the_variable_only_where_the_user_named_none(monkeypatch) -> None:
    monkeypatch.delenv(hugepages.VARIABLE, raising=False)
    hugepages.request()
    assert os.environ[hugepages.VARIABLE] == "1"
    monkeypatch.setenv(hugepages.VARIABLE, "0")
    hugepages.request()
    assert os.environ[hugepages.VARIABLE] == "0"


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"), ("[always] madvise never\n",
                                            "always"), ("always madvise [never]\n", "never"), ("garbled\n", None)])
def test_system_mode_is_the_bracketed_word(tmp_path, monkeypatch, text, mode) -> None:
    path = tmp_path / "enabled"
    path.write_text(text)
    monkeypatch.setattr(hugepages, "_SYSTEM_MODE", path)
    assert hugepages.system_mode() == mode
    monkeypatch.setattr(hugepages, "_SYSTEM_MODE", tmp_path / "absent")
    assert hugepages.system_mode() is None


def _env_line(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != hugepages.VARIABLE}
    if value is not None:
        env[hugepages.VARIABLE] = value
    out = subprocess.run([sys.executable, "-m", "routeformer", "env", "--no-build"], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return next(line for line in out.splitlines() if line.startswith("huge pages:"))


@pytest.mark.slow  # the default suite's slowest (2026-12-07, 7-17 s a worker): CI's slow line runs it
@pytest.mark.skipif(hugepages.system_mode() not in ("madvise", "always"),
                    reason="the system's THP mode gives no huge pages on request")
def test_the_command_line_puts_large_tensors_on_huge_pages_unless_the_user_says_0() -> None:
    line = _env_line(None)
    assert "on (THP_MEM_ALLOC_ENABLE=1," in line, line
    line = _env_line("0")
    assert "THP_MEM_ALLOC_ENABLE=0" in line, line
    if hugepages.system_mode() == "madvise":  # under "always" the kernel gives them without being asked
        assert line.split(":", 1)[1].strip().startswith("off"), line
