"""Bring your own graph: the converters (PyG, DGL, networkx, scipy, edge lists) both ways,
``gnnpar data import`` of each kind of file (and the refusal of a malicious pickle), the
structure options and the directed-graph warning, and ``gnnpar.train.fit`` against
``gnnpar train`` on the same graph folder (one 2-rank run in the whole file)."""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import dgl
import numpy as np
import pytest
import torch
from torch_geometric.data import HeteroData

from gnnpar.cli import main
from gnnpar.data import load_graph, read_meta, save_graph
from gnnpar.graph import Graph
from gnnpar.graph.convert import as_graph
from gnnpar.models.fullgraph.task import FullGraphConfig
from gnnpar.train import fit
from gnnpar.train.config import ConfigError
from gnnpar.train.loop import load_dataset
from gnnpar.train.metrics import read_metrics
from gnnpar.verified import file_entry


def labelled(num_nodes: int = 12, directed: bool = False, weighted: bool = False) -> Graph:
    """A small graph with everything a trainer needs: features, labels of 5 classes of which
    only 0..2 occur (so the stored class count is not what the labels imply), three masks
    and an isolated last node (so the node count is not the largest id + 1)."""
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, num_nodes - 1, (40,), generator=gen)
    dst = torch.randint(0, num_nodes - 1, (40,), generator=gen)
    weight = torch.rand(40, generator=gen) + 0.5 if weighted else None
    role = torch.arange(num_nodes) % 3
    ndata = {
        "feat": torch.randn(num_nodes, 4, generator=gen),
        "label": torch.arange(num_nodes) % 3,
        "train_mask": role == 0,
        "val_mask": role == 1,
        "test_mask": role == 2,
    }
    g = Graph.from_edges(src, dst, num_nodes, weight, ndata, name="mine", coalesce=True)
    g = g if directed else g.to_undirected()
    g.num_classes = 5
    return g


def same(a: Graph, b: Graph) -> None:
    """Same structure, weights, node data (dtypes included) and class count."""
    a, b = a.coalesce(), b.coalesce()
    assert a.num_nodes == b.num_nodes
    assert torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)
    assert (a.edge_weight is None) == (b.edge_weight is None)
    if a.edge_weight is not None:
        torch.testing.assert_close(a.edge_weight, b.edge_weight.to(a.edge_weight.dtype))
    assert set(a.ndata) == set(b.ndata)
    for key in a.ndata:
        assert a.ndata[key].dtype == b.ndata[key].dtype, key
        assert torch.equal(a.ndata[key], b.ndata[key]), key
    assert a.num_classes == b.num_classes == 5


# ---------------------------------------------------------------------- converters
def test_pyg_round_trip_and_hetero_data() -> None:
    g = labelled(weighted=True)
    data = g.to_pyg()
    assert data.num_classes == 5 and torch.equal(data.val_mask, g.val_mask)
    same(Graph.from_pyg(data), g)
    same(as_graph(data), g)
    hetero = HeteroData()  # a typed graph now (tests/test_typed_convert.py for the rest)
    hetero["paper"].x = torch.randn(3, 2)
    hetero["paper", "cites", "paper"].edge_index = torch.tensor([[0, 1], [1, 2]])
    typed = Graph.from_pyg(hetero)
    assert typed.types.node_types == ("paper",) and torch.equal(typed.feat, hetero["paper"].x)
    assert torch.equal(
        typed.to_pyg()["paper", "cites", "paper"].edge_index, torch.tensor([[0, 1], [1, 2]])
    )


def test_dgl_round_trip_and_heterograph() -> None:
    g = labelled(weighted=True)
    d = g.to_dgl()
    assert torch.equal(d.ndata["train_mask"], g.train_mask)
    same(Graph.from_dgl(d, num_classes=5), g)
    hetero = dgl.heterograph(  # a typed graph now (tests/test_typed_convert.py for the rest)
        {("user", "follows", "user"): ([0], [1]), ("user", "buys", "item"): ([0], [0])}
    )
    typed = Graph.from_dgl(hetero)
    assert typed.types.node_types == ("item", "user") and typed.num_edges == 2
    back = typed.to_dgl()
    assert back.canonical_etypes == hetero.canonical_etypes
    assert [t.tolist() for t in back.edges(etype="follows")] == [[0], [1]]


def test_networkx_scipy_and_edge_list_round_trips(tmp_path: Path) -> None:
    g = labelled(weighted=True)
    nxg = g.to_networkx()
    back = Graph.from_networkx(
        nxg, node_attrs=["feat", "label", *(f"{s}_mask" for s in ("train", "val", "test"))]
    )
    same(back, g)
    same(Graph.from_scipy(g.to_scipy(), ndata=g.ndata, num_classes=5), g)
    path = tmp_path / "mine.txt"
    g.to_edge_list(path)
    text = path.read_text()
    assert "# nodes: 12\n" in text
    structure = Graph.from_edge_list(path, ndata=g.ndata)  # the '# nodes' line: 12, not 11
    structure.num_classes = 5
    same(structure, g)
    with pytest.raises(TypeError, match="expected a gnnpar Graph, a PyG Data or a DGL graph"):
        as_graph(nxg)


# ---------------------------------------------------------------------- gnnpar data import
def _import(tmp_path: Path, source: Path, *flags: str) -> Path:
    out = tmp_path / f"imported-{source.name}"
    assert main(["data", "import", str(source), "--out", str(out), *flags]) == 0
    return out


def test_import_each_kind_of_file(tmp_path: Path) -> None:
    g = labelled(weighted=True)
    pt = tmp_path / "data.pt"
    torch.save(g.to_pyg(), pt)
    same(load_graph(_import(tmp_path, pt)), g)
    source = read_meta(tmp_path / "imported-data.pt")["source"]
    assert source["import"]["kind"] == "pyg"
    assert source["import"]["file"] == str(pt.resolve())
    entry = file_entry(pt)
    assert (source["import"]["size"], source["import"]["xxh3_64"]) == (
        entry["size"],
        entry["xxh3_64"],
    )

    binary = tmp_path / "graph.bin"
    dgl.save_graphs(str(binary), [g.to_dgl()], {"num_classes": torch.tensor([5])})
    same(load_graph(_import(tmp_path, binary)), g)

    npz = tmp_path / "adj.npz"
    csr = g.to_scipy()
    np.savez(npz, indptr=csr.indptr, indices=csr.indices, data=csr.data, shape=np.array(csr.shape),
             format=np.array("csr"), num_classes=np.array(5),
             **{k: v.numpy() for k, v in g.ndata.items()})  # fmt: skip
    same(load_graph(_import(tmp_path, npz)), g)

    directed = labelled(directed=True)
    edges = tmp_path / "edges.txt"
    directed.to_edge_list(edges)
    out = load_graph(
        _import(tmp_path, edges, "--dataset-options", "to_undirected=true,self_loops=add")
    )
    expected = directed.to_undirected().add_self_loops()
    assert torch.equal(out.indptr, expected.indptr) and torch.equal(out.indices, expected.indices)
    assert read_meta(tmp_path / "imported-edges.txt")["source"]["structure"] == {
        "to_undirected": True,
        "self_loops": "add",
    }


class _Exploit:
    """Unpickling this calls os.system: what a malicious ``.pt`` file does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_import_refuses_a_malicious_pickle_and_reads_hetero_data(tmp_path: Path, capsys) -> None:
    marker = tmp_path / "ran"
    for name, save in (
        ("evil.pt", torch.save),
        ("evil.pth", lambda obj, path: path.write_bytes(pickle.dumps(obj))),  # a plain pickle
    ):
        path = tmp_path / name
        save(_Exploit(marker), path)
        assert main(["data", "import", str(path), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert not marker.exists() and not (tmp_path / "out").exists()
        assert len(err.strip().splitlines()) == 1 and str(path) in err, err
        if name == "evil.pt":
            assert f"refusing to load it: it names {os.system.__module__}.system" in err
    hetero = HeteroData()
    hetero["a"].x = torch.randn(2, 1)
    hetero["a", "r", "a"].edge_index = torch.tensor([[0], [1]])
    torch.save(hetero, tmp_path / "hetero.pt")  # a typed graph folder now
    assert main(["data", "import", str(tmp_path / "hetero.pt"), "--out", str(tmp_path / "h")]) == 0
    typed = load_graph(tmp_path / "h")
    assert typed.types.node_types == ("a",) and torch.equal(typed.feat, hetero["a"].x)


# ---------------------------------------------------------------------- structure options
def test_structure_options_and_the_directed_warning(tmp_path: Path, capsys) -> None:
    directed = labelled(directed=True)
    directed = directed.add_self_loops()
    folder = save_graph(directed, tmp_path / "directed")
    cfg = FullGraphConfig(
        dataset=str(folder), dataset_options="to_undirected=true,self_loops=remove"
    )
    loaded = load_dataset(cfg, warn_directed=True)
    assert loaded.is_symmetric() and not loaded.has_self_loops()
    assert capsys.readouterr().err == ""
    load_dataset(FullGraphConfig(dataset=str(folder)), warn_directed=True)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "graph 'mine' is directed" in err[0] and "to_undirected=true" in err[0]
    load_dataset(
        FullGraphConfig(dataset=str(folder), dataset_options="to_undirected=false"),
        warn_directed=True,
    )
    assert capsys.readouterr().err == ""  # directed on purpose
    with pytest.raises(ValueError, match="option self_loops: expected one of keep, add, remove"):
        load_dataset(FullGraphConfig(dataset=str(folder), dataset_options="self_loops=twice"))


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_the_streamed_symmetry_check_of_a_folder_equals_the_graphs(tmp_path: Path, chunk) -> None:
    """Pieces smaller than a row, of odd sizes, and one piece: the same answer as the
    in-memory check, on graphs with self loops, an isolated node, and one edge whose reverse
    is missing (a graph that is symmetric but for one edge)."""
    from gnnpar.data.storage import is_symmetric_folder

    undirected = labelled().add_self_loops()
    u, v = undirected.edges()
    keep = torch.ones(u.numel(), dtype=torch.bool)
    keep[int(torch.nonzero(u != v)[0, 0])] = False  # drop one direction of one edge
    one_way = Graph.from_edges(u[keep], v[keep], undirected.num_nodes, ndata=undirected.ndata)
    for i, g in enumerate([undirected, labelled(directed=True), one_way]):
        folder = save_graph(g, tmp_path / str(i))
        assert is_symmetric_folder(folder, chunk_edges=chunk) == g.is_symmetric()
    assert [g.is_symmetric() for g in (undirected, one_way)] == [True, False]


def test_a_launch_from_a_partition_checks_the_dataset_folder_without_loading_it(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Neighbour sampling on several ranks reads only the partition: the check before
    launch reads the folder's node data and its edges in pieces, never the whole graph
    (here: loading it raises), and says the same things as the loading check."""
    import partitioners
    from gnnpar.models.minibatch.task import MiniBatchConfig, MiniBatchTask

    graph = labelled(directed=True)
    folder = save_graph(graph, tmp_path / "g")
    parts = tmp_path / "parts"
    partitioners.write(graph, partitioners.partition(graph, 2, method="random", seed=0), parts)

    def refuse(*args, **kwargs):
        raise AssertionError("the graph was loaded")

    monkeypatch.setattr("gnnpar.data.load", refuse)
    monkeypatch.setattr("gnnpar.data.storage.load_graph", refuse)
    monkeypatch.setattr("gnnpar.models.minibatch.task.load_dataset", refuse)
    cfg = MiniBatchConfig(dataset=str(folder), partitions=str(parts))
    MiniBatchTask.preflight(cfg, 2)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "graph 'mine' is directed" in err[0]
    # no training node: the same one-line error as the loading check's
    untrainable = labelled(directed=True)
    untrainable.ndata["train_mask"] = torch.zeros(graph.num_nodes, dtype=torch.bool)
    other = save_graph(untrainable, tmp_path / "u")
    other_parts = tmp_path / "u-parts"
    cut = partitioners.partition(untrainable, 2, method="random", seed=0)
    partitioners.write(untrainable, cut, other_parts)
    bad = MiniBatchConfig(dataset=str(other), partitions=str(other_parts))
    with pytest.raises(ConfigError, match=r"dataset '.*u': graph 'mine' has no training nodes"):
        MiniBatchTask.preflight(bad, 2)
    # a partition of another graph
    with pytest.raises(ValueError, match=r"partition .*u-parts was cut from graph"):
        MiniBatchTask.preflight(dataclasses.replace(cfg, partitions=str(other_parts)), 2)


# ---------------------------------------------------------------------- fit
def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _end(run: Path) -> dict:
    end = [r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "end"][-1]
    return {k: v for k, v in end.items() if k not in ("event", "time")}


#: The options of every fit here (no dropout: the 2-rank run is compared with one process).
OPTIONS = {"epochs": 3, "seed": 3, "quiet": True, "hidden": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Callable[[str], tuple[Path, dict]]:
    """``fitted(task)``: (run folder, result) of ``fit(task)`` in this process on the directed
    graph with :data:`OPTIONS`, run once per task for the tests that compare with it."""
    runs: dict[str, tuple[Path, dict]] = {}

    def run(task: str) -> tuple[Path, dict]:
        if task not in runs:
            out = tmp_path_factory.mktemp(task) / "fit"
            data = labelled(directed=True).to_pyg()
            runs[task] = out, fit(task, graph=data, out=out, **OPTIONS)  # a Path will do
        return runs[task]

    return run


@pytest.mark.parametrize("task", ["gcn", "sage"])
def test_fit_equals_gnnpar_train_on_the_same_folder(task: str, tmp_path: Path, fitted) -> None:
    run, got = fitted(task)
    same(load_graph(run / "graph"), labelled(directed=True))
    flags = [f"--{k}={v}" for k, v in OPTIONS.items() if k != "quiet"]
    argv = ["train", task, "--dataset", str(run / "graph"), "--out", str(tmp_path), "--quiet"]
    assert main([*argv, *flags]) == 0
    assert len(_losses(run)) == 3
    assert _losses(run) == _losses(tmp_path)
    assert got == _end(tmp_path) and "train_acc" in got


def test_fit_errors_are_the_cli_errors(tmp_path: Path, capsys) -> None:
    g = labelled()
    with pytest.raises(ConfigError) as caught:
        fit("gcn", graph=g, epochs=0, out=str(tmp_path / "a"))
    assert main(["train", "gcn", "--epochs", "0", "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.strip() == f"gnnpar train: error: {caught.value}"
    with pytest.raises(ConfigError, match="unknown key 'epoch' in config"):
        fit("gcn", graph=g, epoch=3, out=str(tmp_path / "a"))
    with pytest.raises(ConfigError, match="give graph= or the option dataset=, not both"):
        fit("sage", graph=g, dataset="sbm", out=str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()  # nothing written before the checks


def test_fit_on_two_processes(tmp_path: Path, fitted, capsys) -> None:
    graph = labelled(directed=True)
    got = fit("gcn", graph=graph, out=str(tmp_path), nprocs=2, **OPTIONS)
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert warned == [warned[0]] and "graph 'mine' is directed" in warned[0]  # said once
    assert got == _end(tmp_path)
    assert set(got) == {"train_acc", "val_acc", "test_acc", "best_step"}  # the best model
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0]["grid"] != {"data": 1, "x": 1, "y": 1, "z": 1}  # two ranks trained
    one, one_got = fitted("gcn")
    # the same options reached the ranks: the same losses, up to the order of the sums
    np.testing.assert_allclose(_losses(tmp_path), _losses(one), rtol=1e-5)
    assert got == one_got
