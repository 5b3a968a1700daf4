"""Full-graph R-GCN: the serial model against PyG's ``RGCNConv``, the parallel models against
the serial one on every grid shape of 1 to 8 ranks, the bytes per axis against the layers'
schedules and against a formula written per relation, the typed shard folder, and the trainer
(``gnnpar train gcn --model rgcn``) training and resuming on another grid.

Float64 throughout, on a typed graph of 23 nodes in three types (one featureless), five
relations (one of a single edge) and a duplicate edge (``small_typed_graph``), widths
5 → 7 → 3: nothing divides the grid. The largest errors measured, |a−b|/(1+|b|): serial
against PyG 2.7e-16, parallel against serial 1.1e-15 (the tests hold 1e-12).

One normalisation over all relations together instead of one per relation (the mutation
of ``relation_adjacencies`` this file was checked against) fails the PyG and the operator
tests; the relations' operators in another order than their weights fail every grid.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar import checkpoint, comm
from gnnpar.errors import UserError
from gnnpar.models.fullgraph import parallelize_fullgraph
from gnnpar.models.fullgraph.relations import (
    RELATION_NORM,
    relation_adjacencies,
    relation_memory_source,
    relation_spmms,
)
from gnnpar.sparse.source import inverse, make_permutations
from gnnpar.testing import grid_shapes, run_distributed
from tests.byte_formulas import chunk_range, rgcn3d_bytes, rows1d_bytes, summa_bytes
from tests.fullgraph_utils import check_schedule, learnt_input, serial_rgcn, small_typed_graph

DIMS = [5, 7, 3]
TOL = 1e-12
WORLDS = (1, 2, 3, 4, 5, 6, 7, 8)


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> float:
    """|a − b| / (1 + |b|) at most ``tol``; returns the largest."""
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}")
    err = float(((a - b).abs() / (1 + b.abs())).max()) if a.numel() else 0.0
    if err > tol:
        raise AssertionError(f"{what}: relative error {err:.3g}")
    return err


# ------------------------------------------------------------------------ serial vs PyG
def _pyg_stack(model, num_relations: int):
    """PyG ``RGCNConv`` layers holding the plain model's weights (PyG's layout: weight
    (R, in, out) or bases (B, in, out) with comp (R, B), root, bias)."""
    from torch_geometric.nn import RGCNConv

    convs = []
    for layer in model.layers:
        d_in, d_out = layer.weight_root.shape
        conv = RGCNConv(d_in, d_out, num_relations, num_bases=layer.num_bases).double()
        with torch.no_grad():
            if layer.num_bases is None:
                conv.weight.copy_(torch.stack(list(layer.weights)))
            else:
                conv.weight.copy_(layer.bases)
                conv.comp.copy_(layer.comp)
            conv.root.copy_(layer.weight_root)
            conv.bias.copy_(layer.bias)
        convs.append(conv)
    return convs


@pytest.mark.parametrize("num_bases", [None, 2])
def test_serial_rgcn_equals_pyg_rgcnconv_forward_and_backward(num_bases):
    """The plain R-GCN (relations' row-normalised Â_r, ReLU between layers) is PyG's
    ``RGCNConv`` stack with aggr mean: logits, input and every weight gradient."""
    graph = small_typed_graph()
    rels = graph.types.num_relations
    torch.manual_seed(0)
    from gnnpar.models.fullgraph.model import RGCN

    model = RGCN(DIMS[0], DIMS[1], DIMS[2], rels, dropout=0.0, num_bases=num_bases).double()
    with torch.no_grad():
        for layer in model.layers:
            layer.bias.normal_()
    convs = _pyg_stack(model, rels)
    src, dst = graph.edges()
    edge_index, edge_type = torch.stack([src, dst]), graph.types.edge_type
    train, y = graph.ndata["train_mask"], graph.ndata["label"]

    x = graph.feat.clone().requires_grad_(True)
    logits = model(relation_spmms(graph), x)
    F.cross_entropy(logits[train], y[train]).backward()
    x_ref = graph.feat.clone().requires_grad_(True)
    h = x_ref
    for i, conv in enumerate(convs):
        h = conv(h, edge_index, edge_type)
        h = torch.relu(h) if i < len(convs) - 1 else h
    F.cross_entropy(h[train], y[train]).backward()

    _close(logits.detach(), h.detach(), "logits")
    _close(x.grad, x_ref.grad, "input grad")
    for i, (layer, conv) in enumerate(zip(model.layers, convs, strict=True)):
        if num_bases is None:
            got = torch.stack([w.grad for w in layer.weights])
            _close(got, conv.weight.grad, f"relation weight grads {i}")
        else:
            _close(layer.bases.grad, conv.weight.grad, f"bases grad {i}")
            _close(layer.comp.grad, conv.comp.grad, f"comp grad {i}")
        _close(layer.weight_root.grad, conv.root.grad, f"root grad {i}")
        _close(layer.bias.grad, conv.bias.grad, f"bias grad {i}")


def test_relation_operators_are_per_relation_means():
    """Â_r's row v is 1/|N_r(v)| on v's in-edges of relation r (duplicates twice), empty
    where r reaches no v; the single-edge relation's one entry is 1."""
    graph = small_typed_graph()
    src, dst = graph.edges()
    et = graph.types.edge_type
    n = graph.num_nodes
    for r, (indptr, indices, values) in enumerate(relation_adjacencies(graph)):
        want = torch.zeros(n, n, dtype=torch.float64)
        mine = et == r
        want.index_put_((dst[mine], src[mine]), torch.ones(int(mine.sum()), dtype=want.dtype),
                        accumulate=True)  # fmt: skip
        deg = want.sum(1, keepdim=True)
        want = torch.where(deg > 0, want / deg.clamp(min=1), want)
        got = torch.zeros(n, n, dtype=torch.float64)
        rows = torch.repeat_interleave(torch.arange(n), indptr[1:] - indptr[:-1])
        got.index_put_((rows, indices), values, accumulate=True)
        _close(got, want, f"relation {r}")
    single = graph.types.relation_index("tags")
    assert graph.types.relation_counts()[single] == 1
    assert relation_adjacencies(graph)[single][2].tolist() == [1.0]


# ------------------------------------------------------------------- parallel vs serial
def _stage_nnz(graph, source, rows: tuple[int, int], col_ranges, layers: int):
    """Stored entries of block (rows, columns j′) of each layer's operators, counted from
    the edge list: relation r's edges u → v sit at (position of v in the row order,
    position of u in the column order); the root has one per node whose row and column
    positions both fall in the block."""
    src, dst = graph.edges()
    et = graph.types.edge_type
    out = []
    for layer in range(layers):
        parity = layer % 2
        row_pos = inverse(source.inv[1 - parity])
        col_pos = inverse(source.inv[parity])
        r_in = (row_pos[dst] >= rows[0]) & (row_pos[dst] < rows[1])
        per_op = []
        for r in range(graph.types.num_relations):
            per_op.append([
                int((r_in & (et == r) & (col_pos[src] >= c0) & (col_pos[src] < c1)).sum())
                for c0, c1 in col_ranges
            ])  # fmt: skip
        ids = source.inv[1 - parity][rows[0] : rows[1]]
        per_op.append([int(((col_pos[ids] >= c0) & (col_pos[ids] < c1)).sum())
                       for c0, c1 in col_ranges])  # fmt: skip
        out.append(per_op)
    return out


def _formula(
    par, grid, graph, source, algorithm: str, chunks: int, bases: int = 0, grad: bool = True
):
    rels, n = graph.types.num_relations, graph.num_nodes
    if algorithm == "3d":
        shape, coords = grid.shape, grid.coords()
        return rgcn3d_bytes(shape, coords, n, DIMS, rels, 8, grad, True, chunks, bases)
    if algorithm == "1d":
        return rows1d_bytes(grid.size("tensor"), n, DIMS, rels + 1, 8, grad, True)
    cols = [chunk_range(n, grid.size("y"), j) for j in range(grid.size("y"))]
    nnz = _stage_nnz(graph, source, par.rows, cols, len(DIMS) - 1)
    return summa_bytes(grid.shape, grid.coords(), n, DIMS, rels + 1, 8, grad, True, nnz)


def _check_shape(
    shape: dict, algorithm: str, chunks: int, seed: int, bases: int = 0, inputs: str = "grad"
) -> float:
    """One grid: the parallel R-GCN (permuted, with dropout; with ``bases`` B > 0 its basis
    decomposition; ``inputs`` ``"grad"``: the input gradient wanted, ``"learn"``: the
    featureless rows learnt, their gradient in place of the input's, ``"raw"``: raw
    features, no input gradient, so the first layer sends neither dAGG nor dH) equals the
    serial one, forward and backward; bytes per axis = formula = schedule."""
    learn = inputs == "learn"
    grid = gnnpar.init(**shape)
    graph = small_typed_graph()
    rels = graph.types.num_relations
    ref = serial_rgcn(DIMS, rels, dropout=0.5, num_bases=bases or None)
    ref.train()
    xr = (
        learnt_input(graph.feat, graph.types, seed) if learn else graph.feat.clone()
    ).requires_grad_(inputs != "raw")
    logits = ref(relation_spmms(graph), xr, dropout_seed=seed)
    train, y = graph.ndata["train_mask"], graph.ndata["label"]
    loss_ref = F.cross_entropy(logits[train], y[train])
    loss_ref.backward()

    perms = make_permutations("random", graph.indptr, graph.indices, seed)
    source = relation_memory_source(graph, perms)
    extra = {"overlap_chunks": chunks} if algorithm == "3d" else {}
    par = parallelize_fullgraph(ref, grid, source, algorithm=algorithm, **extra)
    par.train()
    xl = par.input_features()
    if learn:
        par.learn_featureless(seed)
    elif inputs == "grad":
        xl.requires_grad_(True)
    with comm.record(grid) as fwd:
        out = par(xl, dropout_seed=seed)
    tag = f"{grid.describe()} {algorithm} chunks={chunks} inputs={inputs}"
    ids = source.node_ids(par.output_order, par.logits_rows)
    c0, c1 = par.logits_cols
    worst = _close(out.detach(), logits.detach()[ids][:, c0:c1], f"logits {tag}")
    loss = par.loss(out)
    worst = max(worst, _close(loss.detach(), loss_ref.detach(), f"loss {tag}"))
    with comm.record(grid) as bwd:
        loss.backward()
    full = par.full_weights(grads=True)
    for i, layer in enumerate(ref.layers):
        want = layer.weight_blocks_grad()
        worst = max(worst, _close(full[i]["weight"], want, f"weight grad {i} {tag}"))
        worst = max(worst, _close(full[i]["bias"], layer.bias.grad, f"bias grad {i} {tag}"))
        if bases:
            worst = max(worst, _close(full[i]["comp"], layer.comp.grad, f"comp grad {i} {tag}"))
    in_rows, (f0, f1) = par.input_block
    if learn:  # the learnt rows' gradient: the serial input's at their nodes
        got, ids = par.inputs.weight.grad, par.inputs.node_ids
        assert got is not None and got.shape[0] == ids.numel(), tag
        worst = max(worst, _close(got, xr.grad[ids][:, f0:f1], f"learnt rows grad {tag}"))
    elif inputs == "grad":
        want = xr.grad[source.node_ids(0, in_rows)][:, f0:f1]
        worst = max(worst, _close(xl.grad, want, f"input grad {tag}"))
    else:
        assert xl.grad is None, tag

    # the first layer's input gradient goes to the input or to the learnt rows
    grad = inputs != "raw"
    want_f, want_b = _formula(par, grid, graph, source, algorithm, chunks, bases, grad)
    want_f.check(fwd.as_dict(), f"forward bytes {tag}")
    want_b.check(bwd.as_dict(), f"backward bytes {tag}")
    # learnt rows: the model's own schedule has the input gradient (nothing asks for it)
    check_schedule(fwd, bwd, par.expected_bytes(input_grad=inputs == "grad"), tag)
    gnnpar.release(grid)
    return worst


def _cases(world: int) -> list[tuple[dict, str, int, int, str]]:
    """(shape, algorithm, chunks, bases, inputs): every 3D shape of ``world`` ranks, the
    aggregate in 1 and 2 row chunks in turn, shapes 1, 2, 5, 6, … with 2 bases (of 5
    relations; a world of one shape runs it again with bases), shapes 0, 3, 6, … with the
    featureless rows learnt (a world of one shape: its bases case), the others with the
    input gradient wanted; then the first shape whose x (the first layer's outer axis, over
    which dAGG would go) is > 1 again on raw features, 2 bases and 2 chunks; 1D on all
    ranks, and 2D on the x × y shapes, at 4 and 6 ranks (an odd split at 6), the 2D ones
    learnt too."""
    shapes = grid_shapes(world)
    cases = [
        (s, "3d", 1 + k % 2, 2 if k % 4 in (1, 2) else 0, "learn" if k % 3 == 0 else "grad")
        for k, s in enumerate(shapes)
    ]
    if len(shapes) == 1:
        cases[0] = (*cases[0][:4], "grad")
        cases.append((shapes[0], "3d", 1, 2, "learn"))
    cases.append((next((s for s in shapes if s["x"] > 1), shapes[0]), "3d", 2, 2, "raw"))
    if world in (4, 6):
        cases.append(({"x": world}, "1d", 1, 0, "grad"))
        cases += [({**s, "z": 1}, "2d", 1, 0, "learn") for s in grid_shapes(world, ("x", "y"))]
    return cases


def _check_world(world: int) -> tuple[int, float]:
    worst = 0.0
    cases = _cases(world)
    for k, (shape, algorithm, chunks, bases, inputs) in enumerate(cases):
        worst = max(worst, _check_shape(shape, algorithm, chunks, 11 + k, bases, inputs))
    return len(cases), worst


@pytest.mark.parametrize("world", WORLDS)
def test_parallel_rgcn_equals_serial_on_every_grid(world):
    results = run_distributed(_check_world, world, world, timeout=600)
    assert [count for count, _ in results] == [len(_cases(world))] * world
    assert max(err for _, err in results) <= TOL


def test_parallel_rgcn_refuses_bases_off_3d_untyped_sources_and_relation_counts():
    graph = small_typed_graph()
    grid = gnnpar.init()
    source = relation_memory_source(graph)
    from gnnpar.models.fullgraph.model import RGCN

    with pytest.raises(UserError, match="num_bases: R-GCN bases run on the 3d algorithm, not '2d'"):
        parallelize_fullgraph(RGCN(5, 7, 3, 5, num_bases=2), grid, source, algorithm="2d")
    with pytest.raises(UserError, match="has 4 relations, RelationMemorySource holds .* of 5"):
        parallelize_fullgraph(RGCN(5, 7, 3, 4), grid, source)
    with pytest.raises(UserError, match="a sage model reads the 'mean' adjacency"):
        from gnnpar.models.fullgraph.model import GraphSAGE

        parallelize_fullgraph(GraphSAGE(5, 7, 3), grid, source)
    with pytest.raises(UserError, match="needs num_relations"):
        from gnnpar.models.fullgraph.model import FullGraphGNN

        FullGraphGNN(5, 7, 3, kind="rgcn")
    gnnpar.release(grid)


# ------------------------------------------------------------------------- shard folders
def test_typed_shard_folder_holds_each_relation_and_untyped_folders_still_load(tmp_path):
    """Version 3, ``relations`` and ``relation_edges`` in the meta, the typed graph's
    fingerprint as the source; every relation's blocks equal the memory source's (float32
    on disk); an untyped graph's folder stays version 2 without relations."""
    from gnnpar.models.fullgraph.shards import DiskSource, prepare_shards
    from tests.fullgraph_utils import small_graph

    graph = small_typed_graph()
    out = prepare_shards(graph, tmp_path / "typed", norm=RELATION_NORM, blocks=(2, 2), seed=4)
    manifest = json.loads((out / "manifest.json").read_text())
    meta = manifest["meta"]
    assert manifest["version"] == 3 and meta["norm"] == RELATION_NORM
    assert meta["relations"] == [list(r) for r in graph.types.relations]
    assert meta["relation_edges"] == graph.types.relation_counts()
    assert meta["source"]["graph"] == graph.fingerprint()
    assert any(f.startswith("adj1/rel4/r1_c1.") for f in manifest["files"])
    disk = DiskSource(out)
    perms = make_permutations("random", graph.indptr, graph.indices, 4, 2)
    mem = relation_memory_source(graph, perms, dtype=torch.float32)
    n = graph.num_nodes
    for r in range(disk.num_relations):
        for parity in (0, 1):
            for rows, cols in (((0, n), (0, n)), ((5, 17), (2, 20))):
                a = disk.relation_adjacency(r, parity, rows, cols).to_dense()
                b = mem.relation_adjacency(r, parity, rows, cols).to_dense()
                assert torch.equal(a, b), (r, parity, rows, cols)
    with pytest.raises(UserError, match="one adjacency per relation"):
        disk.adjacency(0, (0, n), (0, n))
    with pytest.raises(UserError, match="needs a typed graph"):
        a, x, y, train = small_graph()
        from gnnpar.graph import Graph

        untyped = Graph.from_edges(*a.nonzero(as_tuple=True)[::-1], num_nodes=a.shape[0])
        untyped.ndata.update(feat=x, label=y, train_mask=train)
        prepare_shards(untyped, tmp_path / "bad", norm=RELATION_NORM)
    plain = prepare_shards(untyped, tmp_path / "plain", norm="mean", blocks=(2, 2))
    doc = json.loads((plain / "manifest.json").read_text())
    assert doc["version"] == 2 and "relations" not in doc["meta"]
    assert DiskSource(plain).num_relations == 0


# ------------------------------------------------------------------------------ trainer
DATA = "num_papers=60,num_authors=30,num_institutions=5,num_fields=7,num_classes=3,feat_dim=6"


def _argv(out: Path, epochs: int, grid: str, *extra: str) -> list[str]:
    return ["train", "gcn", "--model", "rgcn", "--dataset", "mag-synth", "--dataset-options",
            DATA, "--root", str(out.parent / "data"), "--hidden", "5", "--dtype", "float64",
            "--epochs", str(epochs), "--grid", grid, "--nprocs", "2", "--out", str(out),
            "--eval-every", "0", "--quiet", "--blocks", "2", "--dropout", "0", *extra]  # fmt: skip


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_trainer_rgcn_trains_on_mag_synth_and_resumes_on_another_grid(tmp_path, monkeypatch):
    """``gnnpar train gcn --model rgcn`` on mag-synth (7 relations, featureless authors,
    institutions and fields) on z=2, with a weight per relation and with 2 bases (and the
    featureless rows learnt): the loss falls; saved after 2 epochs on x=2 and resumed on
    z=2, it ends where 4 straight epochs on z=2 do (<= 1e-12 relative), the learnt table
    too, which goes back to each featureless type's nodes in their own order. Without
    dropout, so that each epoch's loss is the full-batch loss of its parameters."""
    from gnnpar.graph.typed import TypeSchema
    from gnnpar.models.fullgraph.embedding import EMBEDDING, consolidated_embeddings

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    import gnnpar.models.fullgraph.task  # noqa: F401 - imported once, before the ranks fork
    from tests.cli_world import run_commands

    commands, runs = [], {}
    for bases in ((), ("--bases", "2", "--featureless", "learn")):
        tag = "-bases" if bases else ""
        saved, resumed = tmp_path / f"x2{tag}", tmp_path / f"resumed-z2{tag}"
        straight = tmp_path / f"z2{tag}"
        commands += [
            _argv(saved, 2, "x=2", *bases),
            ("copy", saved, resumed),
            _argv(resumed, 4, "z=2", "--resume", *bases),
            _argv(straight, 4, "z=2", *bases),
        ]
        runs[bool(bases)] = (resumed, straight)
    codes = run_commands(2, commands)
    assert codes == [[0] * 6] * 2
    for bases, (resumed, straight) in runs.items():
        losses = _losses(straight)
        assert len(losses) == 4, losses
        assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
        a, b = checkpoint.consolidate(resumed), checkpoint.consolidate(straight)
        assert list(a) == list(b)
        if bases:  # PyG's names and shapes: bases (B, in, out), comp (R, B)
            assert tuple(a["layers.0.bases"].shape) == (2, 6, 5)
            assert tuple(a["layers.1.comp"].shape) == (7, 2)
            assert not any(".weights." in k for k in a)
        else:
            assert any(".weights.6" in k for k in a)
        if bases:  # the learnt rows: beside the state dict, equal too
            a = {**a, **checkpoint.consolidate_inputs(resumed)}
            b = {**b, **checkpoint.consolidate_inputs(straight)}
            types = TypeSchema.of(json.loads(
                next((tmp_path / "z2-bases" / "shards").glob("*/manifest.json")).read_text()
            )["meta"]["types"])  # fmt: skip
            tables = consolidated_embeddings(straight, types)
            assert {k: tuple(t.shape) for k, t in tables.items()} == {
                "author": (30, 6), "institution": (5, 6), "field_of_study": (7, 6)}  # fmt: skip
            rows = torch.cat(list(tables.values()))
            assert sorted(rows.flatten().tolist()) == sorted(b[EMBEDDING].flatten().tolist())
        for k, v in b.items():
            err = float((a[k] - v).abs().max()) / max(float(v.abs().max()), 1e-300)
            assert err <= TOL, (k, err)


def test_learnt_rows_refuse_shards_of_another_node_order(tmp_path, monkeypatch, capsys):
    """A run with learnt featureless rows resumed on shards of another permutation: one
    line naming the stored ids, not rows of other nodes trained on. ``gnnpar ckpt
    consolidate`` says the rows are kept beside the state dict, and ``--inputs`` writes them
    (weights only); a checkpoint without any is one line."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    from gnnpar.cli import main

    def one_rank(out: Path, *extra: str) -> list[str]:
        argv = [a for a in _argv(out, 1, "x=1", *extra) if a != "--nprocs"]
        argv.remove("2")  # --nprocs 2 (the hidden width is 5)
        return argv

    run = tmp_path / "run"
    argv = one_rank(run, "--featureless", "learn")
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["ckpt", "consolidate", str(run), str(tmp_path / "m.pt")]) == 0
    assert "--inputs FILE writes them" in capsys.readouterr().out
    both = ["ckpt", "consolidate", str(run), str(tmp_path / "m.pt"), "--overwrite"]
    assert main([*both, "--inputs", str(tmp_path / "rows.pt")]) == 0
    rows = torch.load(tmp_path / "rows.pt", weights_only=True)
    stored = checkpoint.consolidate_inputs(run)
    assert sorted(rows) == ["inputs.embedding", "inputs.node_ids"]
    assert all(torch.equal(rows[k], stored[k]) for k in rows)
    plain = tmp_path / "plain"
    assert main(one_rank(plain)) == 0
    capsys.readouterr()
    assert main(["ckpt", "consolidate", str(plain), str(tmp_path / "p.pt"), "--inputs",
                 str(tmp_path / "none.pt")]) != 0  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keeps no tensors beside its state dict" in err[0], err
    capsys.readouterr()
    again = [*argv[: argv.index("--epochs") + 1], "2", *argv[argv.index("--epochs") + 2 :]]
    assert main([*again, "--resume", "--permutation", "none"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "'inputs.node_ids'" in err[-1] and "another node order" in err[-1], err


def test_rgcn_on_an_untyped_dataset_is_one_config_error(tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    from gnnpar.cli import main

    code = main(["train", "gcn", "--model", "rgcn", "--dataset", "karate", "--epochs", "1",
                 "--out", str(tmp_path / "run"), "--quiet"])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "config key 'model': rgcn reads a typed graph" in err, err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--bases", "2", "--algorithm", "2d"], "config key 'bases': R-GCN bases run on the 3d"),
        (["--bases", "-1"], "config key 'bases' (-1) is for rgcn, >= 1"),
        (["--bases", "2", "--model", "sage"], "config key 'bases' (2) is for rgcn"),
        (
            ["--featureless", "learn", "--model", "sage"],
            "config key 'featureless': learnt rows "
            "need a typed graph's shards, which rgcn or a factory taking num_relations reads; sage",
        ),
        (
            [
                "--featureless",
                "learn",
                "--dataset",
                "karate",
                "--model",
                "examples/pyg_models.py:rgcn",
            ],
            "config key 'featureless': dataset 'karate' has no featureless node type",
        ),
        (
            ["--featureless", "learn", "--model", "examples/pyg_models.py:gcn"],
            "config key 'featureless': learnt rows need a typed graph's shards, which a factory "
            "taking num_relations reads",
        ),
        (["--featureless", "yes"], "config key 'featureless' must be one of zero, learn"),
    ],
)
def test_rgcn_bases_off_3d_or_off_rgcn_are_one_config_error(tmp_path, capsys, extra, message):
    from gnnpar.cli import main

    argv = ["train", "gcn", "--model", "rgcn", "--dataset", "mag-synth", "--epochs", "1",
            "--out", str(tmp_path / "run"), "--quiet", *extra]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0 and message in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("bases", [0, 3])
def test_planner_rgcn_bytes_and_weight_memory_equal_the_written_formulas(bases):
    """``gnnpar plan gcn --model rgcn [--bases B]``: the planner's bytes on every rank of an
    uneven 3 × 2 × 2 grid equal ``rgcn3d_bytes`` (loss left out), and its weight memory is
    4 copies (value, gradient, two Adam moments) of the rank's piece of the stored blocks
    (R + 1, or B + 1 with bases), the bias and, with bases, the whole R × B coefficients.
    With bases the featureless rows are learnt too (``--featureless learn``): the first
    layer's input gradient in the bytes, and 4 copies of the table's rows of rank 0's
    input block (its featureless share of the rows) in the memory."""
    from gnnpar.comm import chunk_sizes
    from gnnpar.models.fullgraph.cost import GCNProblem, gcn_collectives
    from gnnpar.models.fullgraph.memory import gcn_memory

    dims, rels, n = [37, 12, 5], 7, 1001
    learnt = 300 if bases else 0
    problem = GCNProblem.from_widths(n, 5000, dims, model="rgcn", relations=rels, bases=bases,
                                     featureless_nodes=learnt)  # fmt: skip
    shape = {"x": 3, "y": 2, "z": 2, "data": 1}
    for rank in range(12):
        coords = {"x": rank % 3, "y": rank // 3 % 2, "z": rank // 6, "data": 0}
        got: dict[str, dict[str, int]] = {}
        for c in gcn_collectives(problem, shape, coords, loss=False):
            got.setdefault(c.axis, {}).setdefault(c.kind, 0)
            got[c.axis][c.kind] += c.total
        f, b = rgcn3d_bytes(shape, coords, n, dims, rels, 4, bool(learnt), True, 1, bases)
        for axis, kinds in b.bytes.items():
            for kind, v in kinds.items():
                f.bytes[axis].setdefault(kind, 0)
                f.calls[axis].setdefault(kind, 0)
                f.bytes[axis][kind] += v
                f.calls[axis][kind] += b.calls[axis][kind]
        f.check(got, f"planner rgcn bases={bases} rank {rank}")
    weights = 0
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
        a, bb, c = (("x", "y", "z"), ("z", "x", "y"))[layer]
        fin = chunk_sizes(d_in, shape[bb])[0]
        fout = chunk_sizes(d_out, shape[a])[0]
        blocks = (bases or rels) + 1
        piece = chunk_sizes(blocks * fin * fout, shape[c])[0]
        weights += 4 * (piece + rels * bases + fout) * 4
    memory = gcn_memory(problem, shape)
    assert memory["weights"] == weights
    # rank 0's input block: rows 0..334 of 1001 over x, their first half over z (167), the
    # first 19 of 37 features over y
    assert memory.get("inputs", 0.0) == pytest.approx(4 * 167 * (learnt / n) * 19 * 4)


def test_typed_shards_record_the_schema_checked_and_an_owned_older_folder_is_rebuilt(tmp_path):
    """A typed folder's meta ``types`` is the graph's schema (a resealed edit that no longer
    fits the relations or the nodes is one ShardFormatError naming it); a run's own typed
    folder written before it was recorded is stale (rebuilt) for learnt featureless rows, a
    given one only checked against the graph."""
    from gnnpar.graph.typed import TypeSchema
    from gnnpar.models.fullgraph.shards import DiskSource, ShardFormatError, prepare_shards
    from gnnpar.models.fullgraph.task import _stale
    from gnnpar.verified import meta_digest

    graph = small_typed_graph()
    out = prepare_shards(graph, tmp_path / "typed", norm=RELATION_NORM, blocks=(2, 2), seed=4)
    assert DiskSource(out).types == graph.types.schema
    assert TypeSchema.of(json.loads((out / "manifest.json").read_text())["meta"]["types"])

    def edited(edit) -> None:
        doc = json.loads((out / "manifest.json").read_text())
        edit(doc["meta"])
        doc["meta_xxh3_64"] = meta_digest(doc["meta"])
        (out / "manifest.json").write_text(json.dumps(doc))

    pristine = (out / "manifest.json").read_text()
    edited(lambda meta: meta["types"]["offsets"].__setitem__(-1, 99))
    with pytest.raises(ShardFormatError, match="meta field 'types'"):
        DiskSource(out)
    (out / "manifest.json").write_text(pristine)
    edited(lambda meta: meta.pop("types"))
    assert DiskSource(out).types is None
    expected = json.loads(pristine)["meta"]["source"]
    assert "before shards recorded the node types" in _stale(out, expected, True, True)
    assert _stale(out, expected, owned=True) is None  # zero rows need no types
    assert _stale(out, expected, owned=False, need_types=True) is None
