"""``prepare gettext``: message pairs from compiled catalogs, split by catalog, deduplicated; read back as pairs.
The tests write their own small ``.mo`` files (a slim machine may have no catalogs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import write_mo
from routeformer.data import DataError, Dataset, prepare, read_pairs
from routeformer.data.gettext import SEPARATOR, read_catalog, split_of


def locale_tree(root: Path, catalogs: dict[str, dict[str, str]], lang: str = "de") -> Path:
    for name, messages in catalogs.items():
        write_mo(root / lang / "LC_MESSAGES" / f"{name}.mo", messages)
    return root


def names_in(split: str, count: int) -> list[str]:
    """Catalog names whose hash puts them in ``split``."""
    found, i = [], 0
    while len(found) < count:
        if split_of(f"cat{i}.mo") == split:
            found.append(f"cat{i}")
        i += 1
    return found


def test_a_catalog_reads_as_pairs_without_contexts_plurals_header_or_untranslated(tmp_path) -> None:
    path = write_mo(tmp_path / "a.mo", {"File": "Datei", "menu\x04Open": "Öffnen", "one file\x00%d files":
                                        "eine Datei\x00%d Dateien", "Untranslated": ""})
    assert sorted(read_catalog(path)) == [("File", "Datei"), ("Open", "Öffnen"), ("one file", "eine Datei")]
    (tmp_path / "broken.mo").write_bytes(b"not a catalog at all")
    with pytest.raises(DataError, match="broken.mo: not a readable .mo catalog"):
        read_catalog(tmp_path / "broken.mo")


def test_prepare_gettext_splits_by_catalog_and_drops_sources_seen_before(tmp_path, capsys) -> None:
    train, valid, test = names_in("train", 2), names_in("valid", 1), names_in("test", 1)
    catalogs = {train[0]: {"Open": "Öffnen", "Save": "Speichern"}, train[1]: {"Quit": "Beenden", "Open": "Auf"},
                valid[0]: {"Open": "Öffne", "Close": "Schließen"}, test[0]: {"Close": "Zu", "Help": "Hilfe"}}
    root = locale_tree(tmp_path / "locale", catalogs)
    meta = prepare("gettext", tmp_path / "data", str(root), lang="de")
    assert meta.name == "gettext-de" and meta.extra["pairs"]["catalogs"] == {
        "train": [f"{n}.mo" for n in sorted(train)], "valid": [f"{valid[0]}.mo"], "test": [f"{test[0]}.mo"]}
    data = Dataset.open("gettext-de", tmp_path / "data")
    got = {s: read_pairs(data, s) for s in ("train", "valid", "test")}
    # train: the first catalog's Open wins; valid and test drop what an earlier split holds
    assert sorted(got["train"]) == sorted([(b"Open", "Öffnen".encode()), (b"Save", b"Speichern"),
                                           (b"Quit", b"Beenden")])
    assert got["valid"] == [(b"Close", "Schließen".encode())]
    assert got["test"] == [(b"Help", b"Hilfe")]
    assert meta.extra["pairs"]["pairs"] == {"train": 3, "valid": 1, "test": 1}
    assert bytes(data.split("test")) == b"Help" + bytes([SEPARATOR]) + b"Hilfe"


def test_a_catalog_that_does_not_read_is_left_out_and_named(tmp_path) -> None:
    train, valid, test = names_in("train", 2), names_in("valid", 1), names_in("test", 1)
    root = locale_tree(tmp_path / "locale", {train[0]: {"Open": "Öffnen"}, valid[0]: {"Close": "Zu"},
                                             test[0]: {"Help": "Hilfe"}})
    # a Latin-1 catalog whose header says UTF-8 (as this machine's net-tools.mo): the same length, misnamed
    path = write_mo(root / "de" / "LC_MESSAGES" / f"{train[1]}.mo", {"Schlie\u00dfen": "Close"}, charset="latin-1")
    path.write_bytes(path.read_bytes().replace(b"charset=latin-1", b"charset=UTF-8  "))
    meta = prepare("gettext", tmp_path / "data", str(root), lang="de")
    assert list(meta.extra["pairs"]["skipped"]) == [f"{train[1]}.mo"]
    assert "codec can't decode" in meta.extra["pairs"]["skipped"][f"{train[1]}.mo"]
    assert meta.extra["pairs"]["pairs"] == {"train": 1, "valid": 1, "test": 1}


def test_prepare_gettext_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(DataError, match="gettext needs it"):
        prepare("gettext", tmp_path / "data")
    with pytest.raises(DataError, match="--lang applies to gettext only"):
        prepare("text", tmp_path / "data", str(tmp_path), lang="de")
    with pytest.raises(DataError, match="no .mo catalogs for language 'fr'"):
        prepare("gettext", tmp_path / "data", str(tmp_path), lang="fr")
    root = locale_tree(tmp_path / "one", {"only": {"A": "B"}})
    with pytest.raises(DataError, match="1 catalog\\(s\\) of 'de'.*need at least 3"):
        prepare("gettext", tmp_path / "data", str(root), lang="de")
    with pytest.raises(DataError, match="prepare gettext --lang de"):
        Dataset.open("gettext-de", tmp_path / "data")
    with pytest.raises(DataError, match="holds no sentence pairs"):
        (tmp_path / "t.txt").write_text("x" * 200)
        prepare("text", tmp_path / "data", str(tmp_path / "t.txt"))
        read_pairs(Dataset.open("text", tmp_path / "data"), "train")


@pytest.mark.skipif(not list(Path("/usr/share/locale/de/LC_MESSAGES").glob("*.mo")),
                    reason="this machine has no German catalogs")
def test_this_machines_german_catalogs_read(tmp_path) -> None:
    meta = prepare("gettext", tmp_path, None, lang="de")
    counts = meta.extra["pairs"]["pairs"]
    assert min(counts.values()) > 0 and sum(counts.values()) > 100
    assert all(reason for reason in meta.extra["pairs"]["skipped"].values())  # each left-out catalog says why
