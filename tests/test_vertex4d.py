"""ScaleGNN's 4D training: uniform vertex samples trained by the full-graph 3D layer over
x × y × z, data groups on top (gnnpar.sampling.vertex, gnnpar.models.scalegnn.task).

One 8-rank world runs every case:

- every x·y·z shape of 1, 2, 4 and 8 ranks with data = 1, of 1, 2 and 4 ranks with
  data = 2, and z = 2 with data = 4 (a shape of fewer than 8 ranks repeated over the pipe
  axis, see ``_shapes``): the vertex set of a step is identical on every rank of a data
  group and differs between groups; the 3D forward (logits block, loss) and the gradients, after
  the data-axis average of :func:`gnnpar.shard.shard`, equal the plain float64 model's on
  the same samples, averaged over the groups (≤ 1e-12); the bytes of each pass per axis
  equal the layer's schedule and the formula of ``tests/byte_formulas.py`` (written out
  there), with the data axis's all-reduce of every local parameter added;
- ``gnnpar train sage --sampler vertex --grid data=2,x=2,y=2`` resumed from a checkpoint
  ends where an uninterrupted run does;
- ``gnnpar predict`` of that run on another 4D grid of the world: the arg-max of the plain
  float64 model's logits on the whole graph (consolidated checkpoint, no gnnpar
  parallelism), whose test accuracy is the run's; and after the world ``gnnpar evaluate``
  in one process: the run's final test accuracy.

In one process: options the vertex sampler cannot take are refused in one line; the
normalisation is unbiased for one linear aggregation layer with the
λ-weighted sum (the mean over many samples of the weighted aggregation equals the full
graph's mean over training nodes within confidence bounds from the samples), for the mean
and the GCN normalisation.
"""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch
import torch.distributed as dist

import gnnpar
from gnnpar import checkpoint, comm
from gnnpar.graph import Graph
from gnnpar.launch import PREFLIGHT_DONE_ENV
from gnnpar.models.fullgraph import parallelize_fullgraph
from gnnpar.sampling import VertexSampler
from gnnpar.sampling.vertex import SubgraphSource, loss_scale
from gnnpar.shard import shard
from gnnpar.testing import grid_shapes, run_distributed
from tests.byte_formulas import all_reduce_bytes, plexus_bytes
from tests.fullgraph_utils import check_schedule, normalise, serial_adj, serial_model, small_graph

N, BUDGET, TOL = 23, 11, 1e-12  # odd: nothing divides the grid
DIMS = {"gcn": [7, 5, 3], "sage": [7, 4, 3]}
Z = 5.0  # standard errors of the confidence bounds


def _graph(n: int = N, seed: int = 0):
    a, x, y, train = small_graph(n=n, seed=seed)
    r, c = a.nonzero(as_tuple=True)
    ones = torch.ones(r.numel(), dtype=torch.float64)  # float64 normalisation
    g = Graph.from_edges(c, r, n, edge_weight=ones, coalesce=True)
    return a, g, x, y, train


def _source(g: Graph, kind: str, x, y, train, nodes) -> SubgraphSource:
    norm = g.row_normalize() if kind == "sage" else g.gcn_norm()
    data = {"label": y, "train_mask": train}
    return SubgraphSource(norm.indptr, norm.indices, norm.edge_weight, x, data, nodes, 3)


def _sample_adj(a_hat: torch.Tensor, nodes: torch.Tensor, n: int) -> torch.Tensor:
    """The sample's Â written out: the full graph's entries, off-diagonal ones times
    (N − 1) / (b − 1)."""
    b = nodes.numel()
    sub = a_hat[nodes][:, nodes] * ((n - 1) / (b - 1))
    sub.diagonal().copy_(a_hat[nodes, nodes])
    return sub


def _close(a, b, what):
    if a.shape != b.shape or not torch.allclose(a, b, atol=TOL, rtol=TOL):
        diff = (a - b).abs().max() if a.shape == b.shape else (a.shape, b.shape)
        raise AssertionError(f"{what}: max diff {diff}")


def _check_shape(shape: dict[str, int], kind: str) -> None:
    grid = gnnpar.init(**shape)
    data, me = grid.size("data"), grid.rank("data")
    a, g, x, y, train = _graph()
    a_hat = normalise(a, kind)
    sampler = VertexSampler(g, BUDGET, 2, seed=3)
    samples = [sampler.batch(0, i).seeds for i in range(data)]  # what each group draws
    nodes = samples[me]
    tag = f"{grid.describe()} {kind}"
    # one vertex set per group, the same on each of its ranks; groups differ
    every = comm.all_gather(nodes, grid, "world").view(grid.world_size, -1)
    for r in range(grid.world_size):
        if not torch.equal(every[r], samples[grid.coords(r)["data"]]):
            raise AssertionError(f"rank {r} drew another vertex set ({tag})")
    if data > 1 and torch.equal(samples[0], samples[1]):
        raise AssertionError(f"data groups drew the same vertices ({tag})")

    ref = serial_model(kind, DIMS[kind])
    par = parallelize_fullgraph(
        copy.deepcopy(ref), grid, _source(g, kind, x, y, train, torch.arange(N)), "3d",
        data_parallel=True,
    )  # fmt: skip
    shard(par, grid, 0)
    # the plain model on every group's sample: its weighted loss, gradients averaged
    want_logits, want_loss = None, None
    for k, s in enumerate(samples):
        model = copy.deepcopy(ref)
        logits = model(serial_adj(_sample_adj(a_hat, s, N)), x[s])
        mask = train[s]
        weight = loss_scale(N, BUDGET, int(train.sum()))
        loss = torch.nn.functional.cross_entropy(logits[mask], y[s][mask], reduction="sum")
        (loss * weight / data).backward()
        for p, q in zip(ref.parameters(), model.parameters(), strict=True):
            p.grad = q.grad if p.grad is None else p.grad + q.grad
        if k == me:
            want_logits, want_loss = logits.detach(), loss.detach() * weight

    par.set_source(_source(g, kind, x, y, train, nodes))
    feats = par.input_features()
    with comm.record(grid) as fwd:
        out = par(feats)
    rows, cols = par.logits_rows, par.logits_cols
    _close(out.detach(), want_logits[rows[0] : rows[1], cols[0] : cols[1]], f"logits {tag}")
    n_train = int(train[nodes].sum())
    loss = par.loss(out) * (n_train * loss_scale(N, BUDGET, int(train.sum())))
    _close(loss.detach(), want_loss, f"loss {tag}")
    with comm.record(grid) as bwd:
        loss.backward()
    full = par.full_weights(grads=True)
    for i, layer in enumerate(ref.layers):
        _close(full[i]["weight"], layer.stacked_weight_grad(), f"weight grad {i} {tag}")
        _close(full[i]["bias"], layer.bias.grad, f"bias grad {i} {tag}")

    # bytes: the 3D layers' (on the sample's BUDGET nodes), then the data axis's all-reduce
    # of every parameter piece this rank holds
    ops = 2 if kind == "sage" else 1
    tensor = {a: grid.size(a) for a in ("x", "y", "z")}
    want_f, want_b = plexus_bytes(tensor, grid.coords(), BUDGET, DIMS[kind], ops, 8, False, True)
    local = sum(p.numel() for p in par.parameters())
    want_b.add("data", "all_reduce", data, local * 8)
    want_f.check(fwd.as_dict(), f"forward bytes {tag}")
    want_b.check(bwd.as_dict(), f"backward bytes {tag}")
    schedule = par.expected_bytes(input_grad=False)
    if data > 1:
        schedule["backward"]["data"] = all_reduce_bytes(data, local * 8)
    check_schedule(fwd, bwd, schedule, tag)
    gnnpar.release(grid)


def _shapes() -> list[dict[str, int]]:
    """Every x·y·z shape of up to 8 ranks with data = 1 or 2, and z = 2 with data = 4. A
    shape of fewer than 8 ranks takes the rest of the world on the pipe axis: the pipe
    blocks are consecutive ranks, independent copies of the shape (the 3D layer and
    :func:`gnnpar.shard.shard` use only x, y, z and data groups, which stay inside a block;
    bytes on any other axis would fail the byte checks)."""
    shapes = [
        {**s, "data": data, "pipe": 8 // (data * group)}
        for data in (1, 2)
        for group in (1, 2, 4, 8)
        if data * group <= 8
        for s in grid_shapes(group)
    ]
    return [*shapes, {"x": 1, "y": 1, "z": 2, "data": 4}]


def _argv(out, epochs: int, *extra: str) -> list[str]:
    return ["train", "sage", "--sampler", "vertex", "--budget", "30", "--grid",
            "data=2,x=2,y=2", "--dataset", "sbm", "--dataset-options", "num_nodes=90,feat_dim=6",
            "--root", str(out.parent / "data"), "--dtype", "float64", "--epochs", str(epochs),
            "--hidden", "8", "--out", str(out), "--eval-every", "0", "--quiet", *extra]  # fmt: skip


#: The grid predict puts the run (trained on data=2,x=2,y=2) on.
PREDICT_GRID = "data=2,x=2,z=2"


def _world(tmp) -> int:
    from gnnpar.cli import main

    dist.init_process_group("gloo")  # the world every grid and command joins
    count = 0
    for i, shape in enumerate(_shapes()):
        _check_shape(shape, ("sage", "gcn")[i % 2])
        count += 1
    saved, resumed, straight = tmp / "saved", tmp / "resumed", tmp / "straight"
    codes = [main(_argv(saved, 2))]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(saved, resumed)
    dist.barrier()
    codes += [main(_argv(resumed, 3, "--resume")), main(_argv(straight, 3))]
    dist.barrier()
    # the trained model on another 4D grid of the 8 ranks (the checkpoint resharded on load)
    codes.append(main(["predict", str(straight), "--grid", PREDICT_GRID, "--out",
                       str(tmp / "pred-8")]))  # fmt: skip
    dist.barrier()
    if codes != [0] * 4:
        raise AssertionError(f"exit codes {codes}")
    return count


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vertex4d")
    counts = run_distributed(_world, 8, tmp, timeout=600, env={PREFLIGHT_DONE_ENV: "1"})
    return tmp, counts


def test_4d_step_equals_the_plain_model_on_the_same_samples_with_bytes(world):
    _, counts = world
    assert counts == [len(_shapes())] * 8


def test_vertex_run_resumes_exactly(world):
    tmp, _ = world
    a = checkpoint.consolidate(tmp / "resumed")
    b = checkpoint.consolidate(tmp / "straight")
    assert list(a) == list(b)
    for k, v in b.items():
        assert torch.equal(a[k], v), k
    s = checkpoint.consolidate(tmp / "saved")
    assert any(not torch.equal(s[k], v) for k, v in b.items())  # it did train on


def _plain_predictions(run, graph) -> torch.Tensor:
    """The arg-max of the plain float64 GraphSAGE's logits on the whole graph (mean Â), in
    original node order: the run's consolidated best checkpoint, no gnnpar parallelism."""
    from gnnpar.models.fullgraph.model import FullGraphGNN
    from gnnpar.sparse.csr import CSRBlock
    from gnnpar.sparse.kernels import LocalSpMM

    model = FullGraphGNN(6, 8, graph.num_classes, 2, 0.0, kind="sage").double()
    model.load_state_dict(checkpoint.consolidate(run / "checkpoints" / "best"))
    a, n = graph.row_normalize(), graph.num_nodes
    adj = LocalSpMM(CSRBlock(a.indptr, a.indices, a.edge_weight.double(), (n, n)))
    model.eval()
    with torch.no_grad():
        return model(adj, graph.feat.double()).argmax(1)


def test_evaluate_and_predict_a_vertex_run_on_any_grid(world, tmp_path, monkeypatch):
    """predict on 8 ranks (data=2,x=2,z=2) gives the plain model's predictions, whose test
    accuracy is the run's; evaluate in one process gives that accuracy too."""
    import json

    import numpy as np

    from gnnpar.cli import main
    from gnnpar.data import load
    from gnnpar.train.metrics import read_metrics

    tmp, _ = world
    run = tmp / "straight"
    end = read_metrics(run / "metrics.jsonl")[-1]
    assert end["event"] == "end"
    graph = load("sbm", root=tmp / "data", num_nodes=90, feat_dim=6)
    want = _plain_predictions(run, graph).numpy()
    got = np.load(tmp / "pred-8" / "predictions.npy", allow_pickle=False)
    assert np.array_equal(got, want)
    test = graph.ndata["test_mask"].numpy().astype(bool)
    assert (want[test] == graph.label.numpy()[test]).mean() == pytest.approx(end["test_acc"])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    one = tmp_path / "eval-1.json"
    assert main(["evaluate", str(run), "--json", str(one)]) == 0
    result = json.loads(one.read_text())
    assert (result["value"], result["step"]) == (end["test_acc"], end["best_step"])
    assert result["grid"] == {"data": 1, "x": 1, "y": 1, "z": 1}


def test_evaluate_refuses_a_grid_for_a_data_parallel_sage_run(world, tmp_path, capsys):
    """--grid places a gcn or vertex run; another sampler's run says so in one line."""
    from gnnpar.cli import main

    tmp, _ = world
    other = tmp_path / "neighbor"
    other.mkdir()
    text = (tmp / "straight" / "config.toml").read_text()
    (other / "config.toml").write_text(text.replace('sampler = "vertex"', 'sampler = "neighbor"')
                                       .replace('grid = "data=2,x=2,y=2"\n', ""))  # fmt: skip
    shutil.copytree(tmp / "straight" / "checkpoints", other / "checkpoints")
    assert main(["evaluate", str(other), "--grid", "x=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = "--grid is for gcn runs, link runs of mode full and sage runs of the vertex sampler"
    assert len(err) == 1 and want in err[0]


@pytest.mark.parametrize("kind", ["sage", "gcn"])
def test_vertex_normalisation_is_unbiased(kind, one_thread):
    """E over samples of Σ_{v ∈ S ∩ train} λ (Â_S X)_v equals the full mean over training
    nodes of (Â X)_v, coordinate by coordinate, within Z standard errors."""
    n, b, draws = 17, 4, 400
    a, g, x, y, train = _graph(n=n, seed=1)
    a_hat = normalise(a, kind)
    full = (a_hat @ x)[train].mean(0)
    sampler = VertexSampler(g, b, 1, seed=5)
    lam = loss_scale(n, b, int(train.sum()))
    values = torch.empty(draws, x.shape[1], dtype=torch.float64)
    for k in range(draws):
        nodes = sampler.batch(0, k).seeds
        src = _source(g, kind, x, y, train, nodes)
        adj = src.adjacency(0, (0, b), (0, b)).to_dense()
        agg = adj @ src.features((0, b), (0, x.shape[1]))
        values[k] = lam * agg[src.node_data("train_mask", 0, (0, b))].sum(0)
    se = values.std(0) / math.sqrt(draws)
    gap = (values.mean(0) - full).abs()
    assert bool((gap <= Z * se + 1e-12).all()), f"{kind}: gaps {gap} vs bounds {Z * se}"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--sampler", "vertex", "--model", "gat"], "3D sage or gcn"),
        (["--sampler", "vertex", "--budget", "1"], "'budget' must be >= 2"),
        (["--sampler", "vertex", "--zero-stage", "2"], "zero_stage 0"),
        (["--grid", "data=2,x=2"], "'grid' is for the vertex sampler"),
    ],
)
def test_vertex_options_are_refused_in_one_line(tmp_path, capsys, flags, says):
    from gnnpar.cli import main

    assert main(["train", "sage", *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
