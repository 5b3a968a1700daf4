"""Trust nothing on disk (issue 17): full-graph shard folders and the text/BPE cache.

Each case is a way stale or changed data used to reach training silently: a dataset
replaced at the same path, a same-size edit of a shard block, a folder of the format before
the manifest, a non-UTF-8 text file, a changed token cache.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from gnnpar.cli import main
from gnnpar.data import load
from gnnpar.data.storage import save_graph
from gnnpar.models.fullgraph.shards import DiskSource, ShardFormatError, prepare_shards


@pytest.fixture(autouse=True)
def _one_process(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("GNNPAR_DATA", str(tmp_path / "data-root"))


def _sbm(tmp_path: Path, **kw):
    return load("sbm", root=str(tmp_path / "gen"), feat_dim=8, num_val=50, num_test=50, **kw)


def _train(dataset: Path, out: Path, *extra: str) -> int:
    args = ["train", "gcn", "--dataset", str(dataset), "--epochs", "2", "--out", str(out)]
    return main([*args, "--blocks", "2", "--quiet", *extra])


def _shard_folder(out: Path) -> Path:
    (folder,) = [p for p in (out / "shards").iterdir() if not p.name.startswith(".")]
    return folder


def test_dataset_replaced_at_same_path_rebuilds_shards(tmp_path, capsys):
    data, run = tmp_path / "mygraph", tmp_path / "run"
    save_graph(_sbm(tmp_path, num_nodes=300), data)
    assert _train(data, run) == 0
    new = _sbm(tmp_path, num_nodes=200, num_classes=3, seed=7)
    save_graph(new, data, overwrite=True)
    assert _train(data, run, "--overwrite") == 0
    source = DiskSource(_shard_folder(run))
    assert (source.num_nodes, source.num_classes) == (200, 3)
    assert source.provenance["graph"] == new.fingerprint()
    assert "made from graph" in capsys.readouterr().err


def _edit_array(path: Path, change) -> None:
    """Rewrite a .npy file with ``change(array)``: same dtype, shape and size."""
    before = path.stat().st_size
    np.save(path, change(np.load(path)))
    assert path.stat().st_size == before


@pytest.mark.parametrize(
    "rel,change",
    [
        ("adj0/r0_c0.values.npy", lambda a: a * 1000),
        ("node/label.0.npy", lambda a: (a + 1) % 4),  # order 0: the output of 2 layers
    ],
)
def test_same_size_edit_of_a_shard_file_is_one_error(tmp_path, capsys, rel, change):
    data, run = tmp_path / "g", tmp_path / "run"
    save_graph(_sbm(tmp_path, num_nodes=200), data)
    assert _train(data, run) == 0
    _edit_array(_shard_folder(run) / rel, change)
    capsys.readouterr()
    assert _train(data, run, "--overwrite") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and rel in err[0] and "checksum" in err[0], err


def _to_old_format(folder: Path) -> None:
    """Turn a shard folder into the format before the manifest (meta.json with crc32s);
    one without a manifest is already in that format."""
    if not (folder / "manifest.json").is_file():
        return
    manifest = json.loads((folder / "manifest.json").read_text())
    files = {
        rel: {"bytes": e["size"], "crc32": zlib.crc32((folder / rel).read_bytes())}
        for rel, e in manifest["files"].items()
    }
    meta = {k: v for k, v in manifest["meta"].items() if k != "source"}
    (folder / "meta.json").write_text(json.dumps({"schema": 1, **meta, "files": files}))
    (folder / "manifest.json").unlink()


def test_old_format_shard_folder_refused_or_rebuilt(tmp_path, capsys):
    graph = _sbm(tmp_path, num_nodes=120)
    given = prepare_shards(graph, tmp_path / "given", blocks=(2, 2))
    _to_old_format(given)
    with pytest.raises(ShardFormatError, match=r"written by an older gnnpar .*: prepare it again"):
        DiskSource(given)
    data, run = tmp_path / "g", tmp_path / "run"
    save_graph(graph, data)
    capsys.readouterr()
    assert _train(data, tmp_path / "run2", "--shards", str(given)) == 2
    assert "prepare it again" in capsys.readouterr().err
    # a folder the run owns is rebuilt, with one line saying so
    assert _train(data, run) == 0
    _to_old_format(_shard_folder(run))
    capsys.readouterr()
    assert _train(data, run, "--overwrite") == 0
    assert (_shard_folder(run) / "manifest.json").is_file()
    assert "older gnnpar" in capsys.readouterr().err


def test_given_shards_of_another_graph_are_refused(tmp_path, capsys):
    other = prepare_shards(_sbm(tmp_path, num_nodes=150), tmp_path / "s", blocks=(2, 2))
    data = tmp_path / "g"
    save_graph(_sbm(tmp_path, num_nodes=160), data)
    capsys.readouterr()
    assert _train(data, tmp_path / "run", "--shards", str(other)) == 2
    err = capsys.readouterr().err
    assert "was made from graph" in err and str(other) in err


def test_non_utf8_text_names_file_and_offset(tmp_path):
    from gnnpar.data.text import load_corpus

    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello world\n" * 10 + b"caf\xe9\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}: not UTF-8 text (byte offset 123")):
        load_corpus(path, 260)
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "a.txt").write_text("fine text " * 20)
    (folder / "b.txt").write_bytes(b"\x80oops")
    with pytest.raises(
        ValueError, match=re.escape(f"{folder / 'b.txt'}: not UTF-8 text (byte offset 0")
    ):
        load_corpus(folder, 260)


def test_stale_text_cache_is_rebuilt(tmp_path, capsys):
    from gnnpar.data.text import load_corpus

    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    fresh = np.array(load_corpus(path, 260).tokens)
    cache = Path(f"{path}.bpe260.tokens.npy")
    np.save(cache, fresh[::-1].copy())  # same size, other tokens
    capsys.readouterr()
    again = load_corpus(path, 260)
    assert np.array_equal(np.array(again.tokens), fresh)
    assert "tokens.npy differs from its record" in capsys.readouterr().err
    # the same text of the same size, another byte: a new fingerprint, a new cache
    path.write_text("the quick brown fox jumps over the lazy cat\n" * 40)
    other = load_corpus(path, 260)
    assert other.decode(other.tokens.tolist()) == path.read_text()
    assert "made from another version of the text" in capsys.readouterr().err
