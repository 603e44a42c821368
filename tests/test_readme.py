"""The README and the docs/ pages cannot drift from the code: every Python example of theirs runs as written,
every command's usage summary (the README's "Command line") lists exactly the options its parser takes, and every
benchmark table has the header its command prints."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from routeformer.attention import KINDS

README = Path(__file__).resolve().parents[1] / "README.md"
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]  # the README, then the docs pages
# (page, its index among the page's examples, the example's code)
EXAMPLES = [(page, i, code) for page in PAGES
            for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]


def test_the_readme_has_examples() -> None:
    assert any(page == README for page, _, _ in EXAMPLES) and len(EXAMPLES) >= 3


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_python_example_runs(index: int, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples may write files (save_pretrained)
    page, number, code = EXAMPLES[index]
    saved = dict(KINDS)
    try:
        exec(compile(code, f"{page}:example {number + 1}", "exec"), {})
    finally:  # a kind an example registers must not reach the other tests of this process
        KINDS.clear()
        KINDS.update(saved)


def _code_blocks(text: str) -> list[list[str]]:
    blocks: list[list[str]] = []
    inside: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            if inside is None:
                inside = []
            else:
                blocks.append(inside)
                inside = None
        elif inside is not None:
            inside.append(line)
    return blocks


def usage_summaries(text: str) -> dict[tuple[str, ...], str]:
    """Command (('train',), ('bench', 'model'), ...) -> the text of its usage lines in the README's plain blocks:
    a line `routeformer CMD [SUB] [--option ...]`, its indented continuation lines, and a block's closing
    comment lines (`# every one also takes ...`), which hold for every command of the block."""
    usage: dict[tuple[str, ...], str] = {}
    for block in _code_blocks(text):
        current, here = None, []
        for line in block:
            if line.startswith("routeformer "):
                key = []
                for word in line.split()[1:]:
                    if word == "RUN_DIR":
                        continue
                    if not re.fullmatch(r"[a-z_]+", word):
                        break
                    key.append(word)
                current = tuple(key) if key and not re.search(r"\w\|\w", line.split("[")[0]) else None
                if current:
                    usage[current] = usage.get(current, "") + line
                    here.append(current)
            elif current and line.startswith(" "):
                usage[current] += line
            elif line.startswith("# ") and here:
                for key in here:
                    usage[key] += line
            else:
                current = None
    return usage


def _subparser(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> argparse.ArgumentParser:
    for action in parser._actions:
        if path and isinstance(action, argparse._SubParsersAction):
            return _subparser(action.choices[path[0]], path[1:])
    return parser


USAGE = usage_summaries(README.read_text())


def test_the_readme_summarises_every_command() -> None:
    assert {("prepare",), ("train",), ("evaluate",), ("sample",), ("bench", "attention"), ("bench", "model"),
            ("bench", "recall"), ("bench", "text"), ("analyze", "approximations"), ("analyze", "heads"),
            ("analyze", "patterns")} <= set(USAGE)


@pytest.mark.parametrize("command", sorted(USAGE))
def test_a_usage_summary_lists_exactly_the_options_of_its_command(command: tuple[str, ...]) -> None:
    from routeformer.cli import build_parser

    parser = _subparser(build_parser(), command)
    takes = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    shown = set(re.findall(r"--[a-z][a-z-]*", USAGE[command]))
    assert shown == takes, f"README lacks {sorted(takes - shown)}; the parser lacks {sorted(shown - takes)}"


def _tables(text: str) -> list[list[str]]:
    """The header cells of every Markdown table in ``text``."""
    lines = text.splitlines()
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for i, line in enumerate(lines)
            if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))]


def _printed_headers() -> dict[tuple[str, str], list[str] | tuple[list[str], ...]]:
    """What each benchmark command prints as its table's header, keyed by its first two cells (a tuple: the
    headers it prints in its different modes)."""
    from routeformer.bench import attention, model, recall, roofline, text

    def header(table: str) -> list[str]:
        return [c.strip() for c in table.splitlines()[0].strip().strip("|").split("|")]

    base = {"n": 1, "baseline": True}
    return {
        ("N", "mechanism"): header(attention.attention_table([{**base, "mechanism": "full", "settings": "",
                                                               "fwd_s": 1.0, "fwd_bwd_s": 1.0,
                                                               "inference_bytes": 1, "training_bytes": 1}])),
        ("N", "model"): header(model.training_table([{**base, "model": "full", "params": 1, "step_s": 1.0,
                                                      "tokens_per_s": 1.0, "bytes": 1, "flops_per_token": 1}])),
        ("N", "breakdown: model"): header(model.breakdown_table([{**base, "model": "full", "step_s": 1.0,
                                                                  "parts": dict.fromkeys(model.PARTS, 0.1)}])),
        ("N", "roofline: mechanism"): header(roofline.roofline_table([{**base, "mechanism": "full", "fwd_bwd_s": 1.0,
                                                                       "useful_flops": 1.0}], 1.0)),
        ("task", "attention"): (list(recall.HEADERS), list(recall.HEADERS_FIRST)),  # --reference none: vs first
        ("attention", "seq_len"): header(text.table([])),
    }


def test_benchmark_tables_in_the_readme_have_the_headers_the_commands_print() -> None:
    printed = _printed_headers()
    found = 0
    for cells in (cells for page in PAGES for cells in _tables(page.read_text())):
        key = tuple(cells[:2])
        if key in printed:
            found += 1
            wanted = printed[key] if isinstance(printed[key], tuple) else (printed[key],)
            assert cells in wanted, f"table {cells} differs from what the command prints: {printed[key]}"
        elif cells[0] == "model" and cells[1].startswith("ms/token at "):  # bench model's generation table
            found += 1
            assert all(c.startswith("ms/token at ") for c in cells[1:]), cells
    assert found >= 8
