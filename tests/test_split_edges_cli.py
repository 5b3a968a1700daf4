"""``gnnpar data split-edges``: a link-prediction split saved with its message-passing graph."""

from __future__ import annotations

from pathlib import Path

import pytest

from gnnpar.cli import main
from gnnpar.data import load
from gnnpar.data.storage import load_graph

SMALL = "num_nodes=200,seed=3"


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _split(tmp_path: Path, dataset: str, out: Path, *flags: str) -> int:
    options = ["--dataset-options", SMALL] if dataset == "sbm" else []
    argv = ["data", "split-edges", dataset, "--out", str(out), "--root", str(tmp_path)]
    return main([*argv, *options, *flags])


@pytest.fixture
def split_folder(tmp_path: Path) -> Path:
    out = tmp_path / "sbm-split"
    assert _split(tmp_path, "sbm", out, "--val", "0.1", "--test", "0.2") == 0
    return out


def test_the_folder_loads_with_a_split_of_the_dataset(tmp_path, capsys, split_folder):
    graph = load_graph(split_folder)
    split = graph.edge_split
    assert split is not None and split.protocol == "pairs" and split.metric == "rocauc"
    whole = load("sbm", tmp_path, num_nodes=200, seed=3)
    assert split.source["fingerprint"] == whole.fingerprint()
    assert split.val.shape[1] > 0 and split.test.shape[1] > split.val.shape[1]
    line = capsys.readouterr().out.strip()
    assert str(split_folder) in line and "train" in line and "rocauc" in line
    assert main(["data", "info", str(split_folder)]) == 0
    info = capsys.readouterr().out
    assert "edge split" in info and split.record()["source"] in info


def test_a_missing_time_attribute_is_one_line(tmp_path, capsys):
    assert _split(tmp_path, "sbm", tmp_path / "out", "--by-time", "year") == 2
    line = _err_line(capsys)
    assert "split-edges: error:" in line and "'year'" in line
    assert not (tmp_path / "out").exists()


def test_an_existing_out_is_refused_without_overwrite(tmp_path, split_folder, capsys):
    before = (split_folder / "manifest.json").read_bytes()
    assert _split(tmp_path, "sbm", split_folder, "--seed", "1") == 2
    assert "already exists" in _err_line(capsys)
    assert (split_folder / "manifest.json").read_bytes() == before
    assert _split(tmp_path, "sbm", split_folder, "--seed", "1", "--overwrite") == 0
    assert (split_folder / "manifest.json").read_bytes() != before


def test_a_folder_that_has_a_split_is_refused(tmp_path, split_folder, capsys):
    assert _split(tmp_path, str(split_folder), tmp_path / "again") == 2
    assert "already has an edge split" in _err_line(capsys)
    assert not (tmp_path / "again").exists()


def test_out_equal_to_the_input_folder_is_refused(tmp_path, capsys):
    whole = tmp_path / "whole"
    prepare = ["data", "prepare", "sbm", "--out", str(whole), "--dataset-options", SMALL]
    assert main([*prepare, "--root", str(tmp_path)]) == 0
    files = {p: p.read_bytes() for p in sorted(whole.rglob("*")) if p.is_file()}
    capsys.readouterr()
    for flags in ((), ("--overwrite",)):
        assert _split(tmp_path, str(whole), whole, *flags) == 2
        assert "split-edges: error:" in _err_line(capsys)
    assert {p: p.read_bytes() for p in sorted(whole.rglob("*")) if p.is_file()} == files
    assert load_graph(whole).edge_split is None


def test_train_link_trains_on_the_stored_split(tmp_path, split_folder):
    run = tmp_path / "run"
    argv = ["train", "link", "--dataset", str(split_folder), "--split", "stored"]
    assert main([*argv, "--epochs", "1", "--quiet", "--out", str(run), "--hidden", "8"]) == 0
    assert (run / "metrics.jsonl").is_file()
