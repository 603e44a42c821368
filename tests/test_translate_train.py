"""Encoder-decoder runs from the command line (``train --config translate`` and its own files): batches of pairs,
the run directory, exact resume, evaluate with chrF / BLEU, sample translating, the configuration's tables and
errors. On toy catalogs written by the tests (a slim machine may have none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import write_mo
from routeformer.cli import main
from routeformer.data import Dataset, prepare, read_pairs
from routeformer.data.gettext import split_of
from routeformer.data.pairs import IGNORED, START, PairBatches, fitting, pair_batch
from routeformer.train import load_run_config
from routeformer.train.runs import read_run_config
from routeformer.train.seq2seq_config import Seq2SeqRun

WORDS = [("file", "Datei"), ("open", "öffnen"), ("save", "speichern"), ("close", "schließen"), ("new", "neu"),
         ("folder", "Ordner"), ("error", "Fehler"), ("print", "drucken")]

CONFIG = """
[model]
dim = 16
heads = 4
positions = "absolute"

[encoder]
depth = 1
seq_len = 32
attention = "local:2,routing:2"

[encoder.options.local]
window = 4

[encoder.options.routing]
num_clusters = 2
window = 8
probes = 1
balance = 0.0

[decoder]
depth = 1
seq_len = 40
attention = "local:2,full:2"

[decoder.options.local]
window = 4

[cross]
attention = "routing:2,full:2"

[cross.options.routing]
num_clusters = 2

[train]
device = "cpu"
data = "gettext-de"
batch_size = 8
grad_accum = {accum}
lr = 3e-3
warmup_steps = 2
max_steps = 8
eval_every = 4
eval_tokens = 256
log_every = 1
"""


def toy_catalogs(root: Path) -> Path:
    """Catalogs of word pairs, two-word phrases and numbered messages: some in every split."""
    found = {"train": [], "valid": [], "test": []}
    i = 0
    while min(len(found["valid"]), len(found["test"])) < 1 or len(found["train"]) < 3:
        found[split_of(f"toy{i}.mo")].append(f"toy{i}")
        i += 1
    names = found["train"][:3] + found["valid"][:1] + found["test"][:1]
    for c, name in enumerate(names):
        messages = {}
        for j, (a, b) in enumerate(WORDS):
            for k, (x, y) in enumerate(WORDS):
                if (j + k + c) % 5 == 0:
                    messages[f"{a} {x} {c}{j}"] = f"{b} {y} {c}{j}"
        write_mo(root / "de" / "LC_MESSAGES" / f"{name}.mo", messages)
    return root


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("translate")
    prepare("gettext", root / "data", str(toy_catalogs(root / "locale")), lang="de")
    (root / "one.toml").write_text(CONFIG.format(accum=1))
    (root / "accum.toml").write_text(CONFIG.format(accum=2))
    return root


def run_args(toy: Path, out: Path, *more: str, config: str = "one.toml") -> list[str]:
    return ["train", "--config", str(toy / config), "--data-dir", str(toy / "data"), "--out", str(out), *more]


def rows(run: Path, split: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


# --- batches of pairs -----------------------------------------------------------------------------------------


def test_a_pair_batch_is_start_then_target_in_and_target_then_end_as_labels() -> None:
    b = pair_batch([(b"ab", b"xyz"), (b"c", b"")])
    assert b.source.tolist() == [[97, 98], [99, 0]]
    assert b.source_padding.tolist() == [[True, True], [True, False]]
    assert b.target_in.tolist() == [[START, 120, 121, 122], [START, START, START, START]]
    assert b.labels.tolist() == [[120, 121, 122, START], [START, IGNORED, IGNORED, IGNORED]]
    assert fitting([(b"ab", b"xyz"), (b"abc", b"x"), (b"", b"x"), (b"a", b"wxyz")], 2, 4) == [(b"ab", b"xyz")]


def test_pair_batches_cover_an_epoch_once_in_similar_lengths_and_split_across_ranks() -> None:
    gen = torch.Generator().manual_seed(0)
    pairs = [(bytes([65] * int(n)), bytes([66] * int(m))) for n, m in torch.randint(1, 60, (203, 2), generator=gen)]
    batches = PairBatches(pairs, 8, seed=3)
    assert batches.per_epoch == 25
    seen = [i for e in batches.order(0) for i in e.tolist()]
    assert len(seen) == len(set(seen)) == 200  # each pair at most once an epoch, the remainder left over
    spread = [max(len(pairs[i][1]) for i in b.tolist()) - min(len(pairs[i][1]) for i in b.tolist())
              for b in batches.order(0)]
    longer = [max(max(len(pairs[i][0]), len(pairs[i][1]) + 1) for i in b.tolist()) for b in batches.order(0)]
    assert sum(spread) / len(spread) < 30 and len(set(longer)) > 10  # lengths alike within, unlike across
    assert [b.tolist() for b in batches.order(1)] != [b.tolist() for b in batches.order(0)]
    again = PairBatches(pairs, 8, seed=3)
    for step in (1, 26, 40):  # a function of (seed, step): epochs 0 and 1, in any order
        whole = batches.batch(step)
        assert torch.equal(again.batch(step).source, whole.source)
        ranks = [PairBatches(pairs, 8, seed=3, share=(r, 2)).batch(step, m, 2) for r in range(2) for m in range(2)]
        got = sorted(bytes(row[p].tolist()) for x in ranks for row, p in zip(x.source, x.source_padding,
                                                                             strict=True))
        want = sorted(bytes(row[p].tolist()) for row, p in zip(whole.source, whole.source_padding, strict=True))
        assert got == want


# --- the run --------------------------------------------------------------------------------------------------


def test_a_run_trains_scores_its_translations_and_reads_back(toy: Path, capsys) -> None:
    out = toy / "run"
    assert main(run_args(toy, out)) == 0
    printed = capsys.readouterr().out
    assert "encoder-decoder model" in printed and "validation bits per target byte" in printed
    assert "validation translation: chrF" in printed and "copying the source: chrF" in printed
    for name in ("checkpoint.pt", "config.toml", "model.safetensors", "best/model.safetensors", "metrics.jsonl"):
        assert (out / name).is_file(), name
    [scores] = rows(out, "valid_translation")
    assert 0 <= scores["chrf"] <= 100 and scores["pairs"] == len(read_pairs(Dataset.open("gettext-de",
                                                                                       toy / "data"), "valid"))
    assert [r["step"] for r in rows(out, "valid")] == [4, 8]
    saved = read_run_config(out)
    assert isinstance(saved, Seq2SeqRun) and saved == load_run_config(toy / "one.toml", None,
                                                                       {"data_dir": str(toy / "data")})


def test_resume_matches_an_uninterrupted_run_exactly(toy: Path) -> None:
    whole, part = toy / "whole", toy / "part"
    assert main(run_args(toy, whole)) == 0
    assert main(run_args(toy, part, "--max-steps", "5", "--set", "decay_steps=8")) == 0
    assert main(["train", "--resume", str(part), "--max-steps", "8"]) == 0
    assert {r["step"]: r["loss"] for r in rows(whole, "train")} == {r["step"]: r["loss"] for r in rows(part, "train")}
    wa = torch.load(whole / "checkpoint.pt", weights_only=True)["model"]
    wb = torch.load(part / "checkpoint.pt", weights_only=True)["model"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any("cross.groups" in k and k.endswith("kmeans.centroids") for k in wa)  # the cross heads' k-means too


def test_evaluate_and_sample_translate(toy: Path, capsys) -> None:
    out = toy / "run"
    if not (out / "checkpoint.pt").is_file():
        assert main(run_args(toy, out)) == 0
    capsys.readouterr()
    assert main(["evaluate", str(out), "--split", "test"]) == 0
    printed = capsys.readouterr().out
    assert "bits per target byte" in printed and "on the test split of gettext-de" in printed
    assert "translation (greedy" in printed and "chrF" in printed and "BLEU" in printed
    assert main(["evaluate", str(out), "--beams", "3"]) == 0
    assert "beam search, 3 beams" in capsys.readouterr().out
    assert main(["sample", str(out), "--prompt", "open file 12"]) == 0
    greedy = capsys.readouterr().out
    assert main(["sample", str(out), "--prompt", "open file 12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy  # a translation is greedy unless told otherwise
    assert main(["sample", str(out), "--prompt", "open file 12", "--beams", "2"]) == 0
    for args, fragment in ((["evaluate", str(out), "--stride", "4"], "--stride: an encoder-decoder run scores"),
                           (["analyze", str(out), "heads"], "is an encoder-decoder run: this analysis reads"),
                           (["sample", str(out), "--prompt", "x" * 40], "this model reads sources of at most 32"),
                           (["sample", str(out), "--prompt", "open", "--tokens", "50"], "targets hold at most 39"),
                           (["sample", str(out), "--prompt", "open", "--beams", "2", "--temperature", "1"],
                            "beam search is deterministic")):
        assert main(args) != 0, args
        assert fragment in capsys.readouterr().err, args


def test_two_processes_follow_one_process_with_the_same_global_batch(toy: Path) -> None:
    """DDP over gloo: two processes of 4 pairs each follow one process of two micro-batches of 4; every stack's
    centroids (the encoder's, the cross heads') stay in sync (validation checks it on every rank)."""
    one, two = toy / "accum", toy / "ddp"
    assert main(run_args(toy, one, config="accum.toml")) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "routeformer",
         *run_args(toy, two)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es)" in done.stdout and done.stdout.count("validation translation") == 1
    a, b = rows(one, "train"), rows(two, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4), (x, y)
    c1 = torch.load(one / "checkpoint.pt", weights_only=True)["model"]
    c2 = torch.load(two / "checkpoint.pt", weights_only=True)["model"]
    centroids = [k for k in c1 if k.endswith("kmeans.centroids")]
    assert any(k.startswith("encoder") for k in centroids) and any("cross" in k for k in centroids)
    for key in centroids:
        torch.testing.assert_close(c2[key], c1[key], rtol=1e-4, atol=1e-5)


# --- the configuration ----------------------------------------------------------------------------------------


def test_the_shipped_translate_config_is_an_encoder_decoder_run_with_routing_cross_heads() -> None:
    """What docs/model.md measured: a local encoder of windows of 4 (routing there cost 4 chrF on these short
    sources) and routing among the cross heads."""
    run = load_run_config("translate")
    assert isinstance(run, Seq2SeqRun) and run.train.data == "gettext-de"
    assert "routing" in run.model.cross and run.model.encoder.attention == "local:4"
    assert run.model.encoder.options["local"].window == 4
    assert run.model.encoder.dim == run.model.decoder.dim


def test_overrides_reach_the_table_they_name(toy: Path) -> None:
    path = toy / "one.toml"
    run = load_run_config(path, ["model.dim=24", "encoder.depth=2", "decoder.options.local.window=8",
                                 "cross.attention=full", "cross.options.moba.block=4", "lr=1e-3", "train.seed=5",
                                 "dropout=0.1"])
    m = run.model
    assert m.encoder.dim == m.decoder.dim == 24 and m.encoder.dropout == m.decoder.dropout == 0.1
    assert (m.encoder.depth, m.decoder.depth) == (2, 1) and m.decoder.options["local"].window == 8
    assert m.encoder.options["local"].window == 4 and m.cross == "full" and m.cross_options["moba"].block == 4
    assert (run.train.lr, run.train.seed) == (1e-3, 5)


@pytest.mark.parametrize(("item", "fragment"), [
    ("encoder.dimm=3", "--set encoder.dimm: unknown key"),
    ("cross.window=3", "[cross] takes attention and options"),
    ("cross.options.routing.bogus=1", "bogus"),
    ("encoder.options.routing.bogus=1", "options.routing has no field 'bogus'"),
    ("repeat_steps=10", "repeat_steps = 10: an encoder-decoder run on pairs has no use for it"),
    ("eval_overlap=0.5", "eval_overlap = 0.5"),
    ("fsdp=true", "fsdp = True"),
    ("compile=true", "compile = true"),
    ("encoder.dim=32", "encoder.dim (32) and decoder.dim (16) must be equal"),
])
def test_bad_settings_are_one_line_errors(toy: Path, item: str, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        load_run_config(toy / "one.toml", [item])
    assert fragment in str(err.value)


def test_unknown_tables_and_keys_in_the_file_are_named(tmp_path) -> None:
    path = tmp_path / "x.toml"
    path.write_text("[encoder]\ndepth = 1\n[optimizer]\nlr = 1\n")
    with pytest.raises(ValueError, match=r"unknown top-level keys \['optimizer'\]"):
        load_run_config(path)
    path.write_text("[cross]\nattention = \"full\"\nwindow = 3\n")
    with pytest.raises(ValueError, match=r"unknown \[cross\] keys \['window'\]"):
        load_run_config(path)


def test_the_first_use_of_gettext_lang_prepares_it_from_the_machine_s_catalogs(tmp_path, monkeypatch, capsys) -> None:
    from routeformer.data import gettext, prepare_builtin

    monkeypatch.setattr(gettext, "LOCALES", toy_catalogs(tmp_path / "locale"))
    prepare_builtin("gettext-de", tmp_path / "data")
    assert "preparing the gettext-de data set" in capsys.readouterr().out
    assert read_pairs(Dataset.open("gettext-de", tmp_path / "data"), "train")
    prepare_builtin("gettext-de", tmp_path / "data")
    assert capsys.readouterr().out == ""  # once


def test_a_run_without_sacrebleu_is_refused_before_it_trains(toy: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # import sacrebleu then raises ImportError
    out = toy / "no-scores"
    assert main(run_args(toy, out)) != 0
    assert "pip install 'routeformer[translate]'" in capsys.readouterr().err
    assert not out.exists()  # refused before the run directory was made


def test_token_budget_batches_hold_short_pairs_many_to_a_batch_and_split_alike_across_ranks() -> None:
    gen = torch.Generator().manual_seed(1)
    pairs = [(bytes([65] * int(n)), bytes([66] * int(m))) for n, m in torch.randint(1, 60, (300, 2), generator=gen)]
    batches = PairBatches(pairs, 64, seed=2, tokens=256, parts=2)
    epoch = batches.order(0)
    assert sorted(i for b in epoch for i in b.tolist()) == sorted(set(i for b in epoch for i in b.tolist()))
    for b in epoch:
        longest = max(batches.lengths[i] for i in b.tolist())
        assert 2 <= len(b) <= 64 and (len(b) * longest <= 256 or len(b) == 2)  # the budget, or the two parts' least
    sizes = [len(b) for b in epoch]
    assert max(sizes) >= 3 * min(sizes)  # short pairs many to a batch (sides of 1-60 bytes), long ones few
    steps = len(epoch) + 3  # into the second epoch
    for step in (1, steps):
        whole = [bytes(r[p].tolist()) for x in (batches.batch(step, m, 2) for m in range(2))
                 for r, p in zip(x.source, x.source_padding, strict=True)]
        ranks = [bytes(r[p].tolist()) for x in (PairBatches(pairs, 64, seed=2, share=(k, 2), tokens=256,
                                                             parts=2).batch(step) for k in range(2))
                 for r, p in zip(x.source, x.source_padding, strict=True)]
        assert whole == ranks  # one process's two micro-batches are the two processes' parts
    with pytest.raises(ValueError, match="batch_tokens = 512: an encoder-decoder run's batches"):
        load_run_config(None, ["batch_tokens=512"])


def test_analyze_routing_reads_an_encoder_decoder_run(toy: Path, capsys) -> None:
    out = toy / "run"
    if not (out / "checkpoint.pt").is_file():
        assert main(run_args(toy, out)) == 0
    capsys.readouterr()
    assert main(["analyze", str(out), "routing", "--pairs", "3"]) == 0
    printed = capsys.readouterr().out
    assert "3 pairs of the valid split of gettext-de; local window 4" in printed
    lines = (out / "analysis" / "routing_reading.csv").read_text().splitlines()
    assert lines[0] == "stack,layer,first_head,heads,keys_read,keys_there,recall,beyond"
    got = [line.split(",") for line in lines[1:]]
    assert [(r[0], r[2], r[3]) for r in got] == [("encoder", "2", "2"), ("cross", "0", "2")]  # routing:2 in each
    for r in got:
        assert 0 < float(r[4]) <= float(r[5]) and 0 <= float(r[6]) <= 1 + 1e-9
    assert main(["analyze", str(out), "routing", "--baseline", str(out)]) != 0
    assert "--baseline compares language-model runs" in capsys.readouterr().err
