"""Bring your own GNN: plain PyG models (examples/pyg_models.py) parallelized by
``parallelize_pyg`` against the same PyG model in one process, same weights, float64:
logits, loss, every parameter gradient and the BatchNorm running statistics, on every grid
shape of 1, 2, 4 and 8 ranks and on 3 (odd chunks), with the bytes of each pass equal to
the ops' own schedule and, for the models that only aggregate, to a formula written out
here. Then the refusals, and ``gnnpar train gcn --model FILE:FACTORY`` through the trainer
(checkpoint, resume on another grid, consolidate into the user's class with strict=True)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric import nn as gnn

from gnnpar.comm import chunk_sizes, ring_bytes
from gnnpar.errors import UserError
from gnnpar.models.fullgraph.layout import chunk
from gnnpar.models.fullgraph.pyg_planning import choose_pyg_grid, pyg_collectives, trace_model
from gnnpar.models.pyg.model import check_model, gradient_parameters
from gnnpar.plan.comm_model import bytes_by_axis
from tests.fullgraph_utils import dense_to_block, small_graph

SBM = "num_nodes=60,num_classes=3,feat_dim=5"
ZOO = Path(__file__).resolve().parent.parent / "examples" / "pyg_models.py"
N, FEAT, CLASSES = 23, 7, 3
TYPED_FEAT = 5  # small_typed_graph's widest features (papers')


def zoo():
    """examples/pyg_models.py as a module (it is a user's file, not a package)."""
    spec = importlib.util.spec_from_file_location("pyg_models", ZOO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Ties(nn.Module):
    """Max aggregation over values that tie (rounded features times a learnable scale per
    feature): the scale's gradient sees how the maximum's gradient is shared."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(FEAT))
        self.conv = gnn.SAGEConv(FEAT, CLASSES, aggr="max")

    def forward(self, x, edge_index):
        return self.conv(torch.round(x) * self.scale, edge_index)


def cases(z) -> dict:
    """Each supported layer in a small model (max aggregation also over ties), and the four
    composed models of the issue."""
    return {
        "gcn": lambda: z.gcn(FEAT, CLASSES, hidden=6, dropout=0.0),
        "sage-mean": lambda: z.sage(FEAT, CLASSES, hidden=6, dropout=0.0),
        "sage-max": lambda: z.sage(FEAT, CLASSES, hidden=6, aggr="max", dropout=0.0),
        "sage-max-ties": _Ties,
        "gat": lambda: z.gat(FEAT, CLASSES, hidden=2, heads=3, dropout=0.0),
        "sgc": lambda: z.sgc(FEAT, CLASSES, K=3),
        "gatv2-residual-layernorm": lambda: z.gatv2_residual(
            FEAT, CLASSES, hidden=6, heads=2, layers=2, dropout=0.0
        ),
        "appnp-k10": lambda: z.appnp(FEAT, CLASSES, hidden=6, K=10, dropout=0.0),
        "gcnii-16": lambda: z.gcnii(FEAT, CLASSES, hidden=6, layers=16, dropout=0.0),
        "gin-jk-cat": lambda: z.gin_jk(FEAT, CLASSES, hidden=6, layers=3, dropout=0.0),
        "gin-jk-max": lambda: z.gin_jk(FEAT, CLASSES, hidden=5, layers=2, mode="max", dropout=0.0),
    }


class _BlockResidual(nn.Module):
    """A typed graph's R-GCN with block-diagonal weights and a residual connection:
    Linear → RGCNConv(2 blocks) + skip → ReLU → RGCNConv(3 blocks)."""

    def __init__(self, relations: int):
        super().__init__()
        self.inp = nn.Linear(TYPED_FEAT, 6)
        self.conv1 = gnn.RGCNConv(6, 6, relations, num_blocks=2)
        self.conv2 = gnn.RGCNConv(6, 3, relations, num_blocks=3)

    def forward(self, x, edge_index, edge_type):
        h = self.inp(x)
        h = F.relu(self.conv1(h, edge_index, edge_type) + h)
        return self.conv2(h, edge_index, edge_type)


def typed_cases(z, relations: int) -> dict:
    """R-GCNs of a typed graph: the example's (plain, and 2 bases), and block-diagonal
    weights with a residual connection; the example's RGAT (plain, and 2 bases)."""
    return {
        "rgcn": lambda: z.rgcn(TYPED_FEAT, 3, relations, hidden=7, dropout=0.0),
        "rgcn-bases": lambda: z.rgcn(
            TYPED_FEAT, 3, relations, hidden=4, num_bases=2, layers=3, dropout=0.0
        ),  # fmt: skip
        "rgcn-blocks-residual": lambda: _BlockResidual(relations),
        "rgat": lambda: z.rgat(TYPED_FEAT, 3, relations, hidden=3, heads=2, dropout=0.0),
        "rgat-bases": lambda: z.rgat(
            TYPED_FEAT, 3, relations, hidden=2, heads=3, num_bases=2, dropout=0.0
        ),  # fmt: skip
    }


def _close(got: torch.Tensor, want: torch.Tensor, scale: float, what: str) -> None:
    """Equal to 1e-12 of the larger of the tensor's own size and ``scale`` (a gradient that
    is zero but for rounding, such as a bias before a BatchNorm, is held to the model's)."""
    err = (got - want).abs().max().item()
    ref = max(want.abs().max().item(), scale)
    assert err <= 1e-12 * ref, f"{what}: {err:.2e} off (scale {ref:.2e})"


def gather_scatter_bytes(
    shape: dict, coords: dict, n: int, d_in: int, d_out: int
) -> tuple[float, float]:
    """Written out: the rank at x = a, y·z = c gathers chunk a of the nodes, ``d_in`` wide,
    over y·z (its sub-chunks padded to the largest) and reduce-scatters the rows X (sub-chunk
    c of every x chunk, padded), ``d_out`` wide: (gather bytes, scatter bytes), each the same
    in backward (its adjoint)."""
    x, yz = shape.get("x", 1), shape.get("y", 1) * shape.get("z", 1)
    a, c = coords["x"], coords["y"] + shape.get("y", 1) * coords["z"]
    lo, hi = chunk(n, x, a)
    sub = max(chunk_sizes(hi - lo, yz))
    rows = max(chunk_sizes(b_hi - b_lo, yz)[c] for b_lo, b_hi in (chunk(n, x, b) for b in range(x)))
    gather = (yz - 1) / yz * yz * sub * d_in * 8 if yz > 1 else 0.0
    scatter = (x - 1) / x * x * rows * d_out * 8 if x > 1 else 0.0
    return gather, scatter


def rgat_bytes(shape: dict, coords: dict, n: int, layers: list[tuple[int, int, int]]):
    """Written out: RGATConv layers ``(in width, heads, heads × channels)``, forward and
    backward, on this rank: H gathered over y·z for the sources and over x for the rows X
    (sub-chunk c of every x chunk), the softmax's row maximum (no gradient) and row sum
    all-reduced over x (|X| × heads), the output's partial sums reduce-scattered over x
    (heads × channels wide, before the last layer's mean); the first layer's gathers of the
    input features have no adjoint."""
    x, yz = shape.get("x", 1), shape.get("y", 1) * shape.get("z", 1)
    c = coords["y"] + shape.get("y", 1) * coords["z"]
    rows_x = sum(chunk_sizes(hi - lo, yz)[c] for lo, hi in (chunk(n, x, b) for b in range(x)))
    forward = backward = 0.0
    for i, (d_in, heads, width) in enumerate(layers):
        g_cols, g_rows = gather_scatter_bytes(shape, coords, n, d_in, d_in)
        _, scatter = gather_scatter_bytes(shape, coords, n, width, width)
        stats = 2 * (x - 1) / x * rows_x * heads * 8 if x > 1 else 0.0
        forward += g_cols + g_rows + 2 * stats + scatter
        backward += (g_cols + g_rows if i else 0.0) + stats + scatter
    return forward, backward


def aggregation_bytes(shape: dict, coords: dict, n: int, width: int) -> tuple[float, float]:
    """Written out: one Â·H of ``width`` features on this rank, forward and backward
    (:func:`gather_scatter_bytes` of that width)."""
    gather, scatter = gather_scatter_bytes(shape, coords, n, width, width)
    return gather + scatter, gather + scatter


def attention_layernorm_bytes(shape: dict, coords: dict, n: int, heads: int, channels: int):
    """Written out: one GATv2 layer (heads × channels wide) and a graph LayerNorm after it,
    forward and backward, on this rank: X_l gathered over y·z and X_r over x (the rows X:
    sub-chunk c of every x chunk), the softmax's row maximum (no gradient) and row sum
    all-reduced over x (|X| × heads), the output reduce-scattered over x, and the norm's two
    scalar sums over every rank; backward the adjoint of each but the maximum."""
    x, yz = shape.get("x", 1), shape.get("y", 1) * shape.get("z", 1)
    a, c = coords["x"], coords["y"] + shape.get("y", 1) * coords["z"]
    lo, hi = chunk(n, x, a)
    sub = max(chunk_sizes(hi - lo, yz))
    parts = [chunk_sizes(b_hi - b_lo, yz)[c] for b_lo, b_hi in (chunk(n, x, b) for b in range(x))]
    width, e = heads * channels, 8
    gather_cols = (yz - 1) * sub * width * e
    rows_x = (x - 1) * max(parts) * width * e  # gather X_r, scatter the output: each once
    stats = 2 * (x - 1) / x * sum(parts) * heads * e if x > 1 else 0.0  # one all-reduce
    p = x * yz
    norm = 2 * 2 * (p - 1) / p * e if p > 1 else 0.0  # two scalar all-reduces
    forward = gather_cols + 2 * rows_x + 2 * stats + norm
    backward = gather_cols + 2 * rows_x + stats + norm  # the maximum has no adjoint
    return forward, backward


def _small_source():
    """The small graph (a dense float64 adjacency, features, labels, train mask) and its
    memory source: the raw adjacency in one random node order."""
    from gnnpar.sparse.source import MemorySource, make_permutations

    a, x, y, train = small_graph(n=N, feat=FEAT, classes=CLASSES)
    raw = dense_to_block(a + torch.eye(N, dtype=a.dtype))
    p = make_permutations("symmetric", raw.indptr, raw.indices, 3)
    data = {"label": y, "train_mask": train}
    source = MemorySource(raw.indptr, raw.indices, raw.values, x, data, p, norm="raw")
    return (a, x, y, train), source


def _against_pyg(grid, shape: dict, name: str, make, source, data, graph_args, in_dim: int,
                 learn: int | None = None):  # fmt: skip
    """``make()`` in one process (PyG's own forwards on ``graph_args``) and parallelized on
    ``source``, same weights, float64: logits, loss, every parameter gradient (a parameter
    PyG gives none must get none) and buffer equal; the bytes equal the ops' own schedule
    and, on rank 0, the planner's trace. ``learn`` (a seed): the featureless rows are
    learnt, their gradients the plain model's input's at their nodes. Returns ``(ref, par,
    fwd, bwd, tag)``."""
    from gnnpar import comm
    from gnnpar.models.fullgraph.pyg import parallelize_pyg
    from tests.fullgraph_utils import check_schedule, learnt_input

    x, y, train = data
    if learn is not None:  # the featureless rows the table starts from, the input's grad
        x = learnt_input(x, source.types, learn).requires_grad_(True)
    torch.manual_seed(0)
    ref = make().double()
    torch.manual_seed(0)
    mine = make().double()
    logits = ref(x, *graph_args)
    loss_ref = F.cross_entropy(logits[train], y[train])
    loss_ref.backward()
    par = parallelize_pyg(mine, grid, source)
    if learn is not None:
        par.learn_featureless(learn)
    with comm.record(grid) as fwd:
        out = par(par.input_features())
    tag = f"{name} on {grid.describe()}" + (" (learnt rows)" if learn is not None else "")
    ids = source.node_ids(0, par.logits_rows)
    _close(out.detach(), logits.detach()[ids], 0.0, f"logits {tag}")
    loss = par.loss(out)
    _close(loss.detach(), loss_ref.detach(), 0.0, f"loss {tag}")
    with comm.record(grid) as bwd:
        loss.backward()
    want = dict(ref.named_parameters())
    scale = max(p.grad.abs().max().item() for p in want.values() if p.grad is not None)
    for key, param in mine.named_parameters():
        if want[key].grad is None:  # a term the layer never reads (RGATConv without mod)
            assert param.grad is None, f"{key} gradient {tag}"
            continue
        _close(param.grad, want[key].grad, 1e-3 * scale, f"{key} gradient {tag}")
    buffers = dict(ref.named_buffers())
    for key, buf in mine.named_buffers():  # BatchNorm running statistics after the step
        _close(buf.double(), buffers[key].double(), 0.0, f"{key} {tag}")
    if learn is not None:
        got, ids = par.inputs.weight.grad, par.inputs.node_ids
        assert got is not None and got.shape[0] == ids.numel(), tag
        if ids.numel():  # a rank may hold no featureless row
            _close(got, x.grad[ids], 1e-3 * scale, f"learnt rows gradient {tag}")
    check_schedule(fwd, bwd, par.expected_bytes(), tag)
    if grid.global_rank == 0:  # the planner's trace of the model prices rank 0's bytes
        torch.manual_seed(0)
        plain = make().double()
        params = [q.numel() for q in gradient_parameters(plain)]
        ops = trace_model(plain, in_dim, input_grad=learn is not None)
        planned = bytes_by_axis(pyg_collectives(ops, params, source.num_nodes, shape, 8, 8))
        measured = {**fwd.by_axis()}
        for axis, b in bwd.by_axis().items():
            measured[axis] = measured.get(axis, 0) + b
        for axis in set(planned) | set(measured):
            calls = fwd.calls(axis=axis) + bwd.calls(axis=axis)
            got, want_b = measured.get(axis, 0), planned.get(axis, 0)
            assert abs(got - want_b) <= calls + 1, (tag, axis, got, want_b)
    return ref, par, fwd, bwd, tag


def _formula(grid, par, fwd, bwd, tag: str, want_f: float, want_b: float) -> None:
    """The measured bytes of a pass and its backward equal ``want_f`` and ``want_b`` plus
    the parameters' gradient sums (an all-reduce over x·y·z), one byte of rounding a call."""
    p_world = grid.size("tensor")
    numel = sum(p.numel() for p in gradient_parameters(par.module))
    want_b += ring_bytes("all_reduce", numel * 8, p_world) if p_world > 1 else 0.0
    got_f, got_b = sum(fwd.by_axis().values()), sum(bwd.by_axis().values())
    assert abs(got_f - want_f) <= fwd.calls() + 1, (tag, got_f, want_f)
    assert abs(got_b - want_b) <= bwd.calls() + 1, (tag, got_b, want_b)


def _grid_check(shape: dict, offset: int = 0, step: int = 1) -> int:
    import gnnpar

    grid = gnnpar.init(**shape)
    (a, x, y, train), source = _small_source()
    edge_index = a.nonzero().T
    checked = 0
    for name, make in list(cases(zoo()).items())[offset::step]:
        ref, par, fwd, bwd, tag = _against_pyg(grid, shape, name, make, source, (x, y, train),
                                               (edge_index,), FEAT)  # fmt: skip
        if name in ("gcn", "sgc", "appnp-k10"):  # only aggregations (and the gradient sums)
            convs = {"gcn": [(6, True), (3, True)], "sgc": [(FEAT, False)] * 3,
                     "appnp-k10": [(CLASSES, True)] * 10}[name]  # fmt: skip
            want_f = want_b = 0.0
            for width, grad in convs:
                f_bytes, b_bytes = aggregation_bytes(shape, grid.coords(), N, width)
                want_f, want_b = want_f + f_bytes, want_b + (b_bytes if grad else 0.0)
            _formula(grid, par, fwd, bwd, tag, want_f, want_b)
        if name == "gatv2-residual-layernorm":  # 2 GATv2 layers of 2 heads × 3, LayerNorms
            f_one, b_one = attention_layernorm_bytes(shape, grid.coords(), N, 2, 3)
            _formula(grid, par, fwd, bwd, tag, 2 * f_one, 2 * b_one)
        checked += 1
    # evaluation: BatchNorm reads its running statistics, the rest is unchanged
    ref.eval(), par.eval()
    logits = ref(x, edge_index)
    ids = source.node_ids(0, par.logits_rows)
    _close(par(par.input_features()).detach(), logits.detach()[ids], 0.0, f"eval logits {tag}")
    checked += _typed_check(grid, shape, offset, step)
    gnnpar.release(grid)
    return checked


def _typed_check(grid, shape: dict, offset: int = 0, step: int = 1) -> int:
    """The typed cases on the small typed graph's relation operators (one random node
    order) against PyG's ``RGCNConv`` and ``RGATConv`` with edge types
    (:func:`_against_pyg`); bytes, per R-GCN layer, one gather of its input width over y·z
    and one reduce-scatter of its output width over x whatever the number of relations,
    and per RGAT layer :func:`rgat_bytes`."""
    from gnnpar.models.fullgraph.relations import relation_memory_source
    from gnnpar.sparse.source import make_permutations
    from tests.fullgraph_utils import small_typed_graph

    graph = small_typed_graph()
    rels, n = graph.types.num_relations, graph.num_nodes
    source = relation_memory_source(graph, make_permutations("symmetric", graph.indptr,
                                                             graph.indices, 5))  # fmt: skip
    src, dst = graph.edges()
    edges = (torch.stack([src, dst]), graph.types.edge_type)
    data = (graph.feat, graph.ndata["label"], graph.ndata["train_mask"])
    checked = 0
    for name, make in list(typed_cases(zoo(), rels).items())[offset::step]:
        learn = 5 if name == "rgcn" else None  # its featureless rows (fields) learnt
        _, par, fwd, bwd, tag = _against_pyg(grid, shape, name, make, source, data, edges,
                                             TYPED_FEAT, learn)  # fmt: skip
        coords = grid.coords()
        if name == "rgat":  # 5 → 2 heads × 3 (concatenated) → 2 heads × 3 (averaged)
            f_want, b_want = rgat_bytes(shape, coords, n, [(TYPED_FEAT, 2, 6), (6, 2, 6)])
            _formula(grid, par, fwd, bwd, tag, f_want, b_want)
        if name == "rgcn":  # 5 → 7 → 3: the input's gather has an adjoint (learnt rows)
            (g1, s1), (g2, s2) = (gather_scatter_bytes(shape, coords, n, i, o)
                                  for i, o in ((TYPED_FEAT, 7), (7, 3)))  # fmt: skip
            _formula(grid, par, fwd, bwd, tag, g1 + s1 + g2 + s2, g1 + s1 + g2 + s2)
        checked += 1
    return checked


def _world(world: int) -> int:
    from gnnpar.testing import grid_shapes

    shapes = grid_shapes(world)
    # at 8 ranks (10 shapes, slow on 2 cores) each model runs on every other shape, in turn
    step = 2 if world == 8 else 1
    return sum(_grid_check(shape, k % step, step) for k, shape in enumerate(shapes))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_pyg_models_equal_pyg_on_every_grid(world):
    """Every x·y·z shape of the world (3: one per axis): the eleven models equal PyG on
    each (at 8 ranks each model on every other shape: 5 or 6 models a shape), and the five
    R-GCNs and RGATs of a typed graph alike (at 8 ranks 2 or 3 a shape)."""
    from gnnpar.testing import grid_shapes, run_distributed

    n, shapes = len(cases(zoo())), len(grid_shapes(world))
    want = n * shapes if world != 8 else sum(len(range(k % 2, n, 2)) for k in range(shapes))
    t = len(typed_cases(zoo(), 5))  # the typed cases, as many shapes as the others
    want += t * shapes if world != 8 else sum(len(range(k % 2, t, 2)) for k in range(shapes))
    assert run_distributed(_world, world, world, timeout=900) == [want] * world


def _bf16_world() -> int:
    import gnnpar
    from gnnpar import comm
    from gnnpar.models.fullgraph.pyg import parallelize_pyg
    from tests.fullgraph_utils import check_schedule

    grid = gnnpar.init(x=2)
    (a, x, y, train), source = _small_source()
    edge_index = a.nonzero().T
    checked = 0
    for name, make in cases(zoo()).items():
        torch.manual_seed(0)
        ref = make().double()
        torch.manual_seed(0)
        par = parallelize_pyg(make(), grid, source, compute_dtype=torch.bfloat16)
        with comm.record(grid) as fwd:
            out = par(par.input_features())
        assert out.dtype in (torch.bfloat16, torch.float32), (name, out.dtype)
        loss = par.loss(out)
        with comm.record(grid) as bwd:
            loss.backward()
        want = ref(x, edge_index).detach()[source.node_ids(0, par.logits_rows)]
        err = (out.double() - want).abs().max() / want.abs().max()
        assert err < 0.05, f"{name}: bf16 logits {err:.3f} off"  # bf16: 8 bits of mantissa
        assert all(p.grad.dtype == torch.float32 for p in par.parameters())  # the masters
        check_schedule(fwd, bwd, par.expected_bytes(), f"{name} bf16")
        checked += 1
    gnnpar.release(grid)
    return checked


def test_bf16_computes_and_sends_in_bfloat16_with_float32_masters():
    """``compute_dtype=bfloat16`` on x=2: the logits within bf16's precision of float64's,
    float32 gradients, and the bytes of every collective those of its recorded dtype."""
    from gnnpar.testing import run_distributed

    assert run_distributed(_bf16_world, 2) == [len(cases(zoo()))] * 2


# ------------------------------------------------------------------------------ refusals
class _Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.ModuleList([gnn.GCNConv(4, 4), gnn.ChebConv(4, 4, K=2)])

    def forward(self, x, edge_index):
        return self.body[1](self.body[0](x, edge_index), edge_index)


def test_an_unsupported_layer_is_one_error_naming_class_place_and_the_list():
    with pytest.raises(
        UserError, match=r"ChebConv at 'body\.1' is a message-passing layer.*GCNConv"
    ):
        check_model(_Unsupported())
    with pytest.raises(UserError, match=r"GCNConv\(improved=True\).*at 'conv1'"):
        check_model(zoo().TwoLayer(lambda i, o: gnn.GCNConv(i, o, improved=True), 4, 4, 2))
    with pytest.raises(UserError, match=r"APPNP\(dropout=0.5\) drops edges.*at 'prop'"):
        m = zoo().appnp(4, 2)
        m.prop.dropout = 0.5
        check_model(m)
    with pytest.raises(UserError, match=r"GRU at 'rnn' is not supported.*supported: GCNConv"):
        m = zoo().gcn(4, 2)
        m.rnn = nn.GRU(4, 4)
        check_model(m)


def test_a_model_and_shards_that_do_not_meet_are_one_line():
    """An R-GCN needs the relations' operators and the other convolutions the raw adjacency:
    each on the other's shards is refused as it is put on the grid, in one line; so are an
    RGCNConv that sums, one with another number of relations than the graph, an RGAT on
    the raw adjacency's shards and an RGATConv with a cardinality modification."""
    import gnnpar
    from gnnpar.models.fullgraph.pyg import parallelize_pyg
    from gnnpar.models.fullgraph.relations import relation_memory_source
    from tests.fullgraph_utils import small_typed_graph

    grid = gnnpar.init()
    try:
        graph = small_typed_graph()
        typed = relation_memory_source(graph)
        _, raw = _small_source()
        cases = [
            (zoo().gcn(TYPED_FEAT, 3), typed, "norm 'raw'"),
            (zoo().rgcn(FEAT, 3, 5), raw, "norm 'mean-per-relation'"),
            (zoo().rgcn(TYPED_FEAT, 3, 4), typed, "num_relations=4, the graph 5 relations"),
            (zoo().rgat(FEAT, 3, 5), raw, "norm 'mean-per-relation'"),
        ]
        for model, source, message in cases:
            with pytest.raises(UserError, match=message) as err:
                par = parallelize_pyg(model.double(), grid, source)
                par(par.input_features())
            assert "\n" not in str(err.value)
        with pytest.raises(UserError, match=r"RGCNConv\(aggr='add'\).*at 'convs\.0'"):
            m = zoo().rgcn(TYPED_FEAT, 3, 5)
            m.convs[0].aggr = "add"
            check_model(m)
        with pytest.raises(UserError, match=r"RGATConv\(mod='scaled'\).*at 'conv2'"):
            m = zoo().rgat(TYPED_FEAT, 3, 5)
            m.conv2.mod = "scaled"
            check_model(m)
    finally:
        gnnpar.release(grid)


def test_the_planner_prices_a_traced_user_model_on_every_shape(capsys):
    """``gnnpar plan gcn --model FILE:FACTORY`` ranks the shapes of a user model (its bytes
    from the trace, which the grid test holds equal to the measured ones); a graph too
    small to spread gathers least on one axis, a wide model's rows want both."""
    from gnnpar.cli import main
    from gnnpar.plan.machines import get_machine

    model = zoo().appnp(128, 16, hidden=64, K=10)
    cpu = get_machine("cpu")
    assert choose_pyg_grid(model, 128, 1 << 20, 1 << 24, 1, cpu) == {"x": 1, "y": 1, "z": 1}
    assert choose_pyg_grid(model, 128, 1 << 20, 1 << 24, 8, cpu)["x"] > 1
    argv = ["plan", "gcn", "--gpus", "4", "--machine", "cpu", "--nodes", "100000",
            "--edges", "1M", "--features", "128", "--classes", "16",
            "--model", f"{ZOO}:gatv2_residual", "--model-options", "hidden=32"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gatv2_residual on graph" in out and " yz " in out


# ------------------------------------------------------------------- through the trainer
def _train(tmp_path: Path, out: str, *extra: str) -> None:
    from gnnpar.cli import main

    argv = ["train", "gcn", "--dataset", "sbm", "--dataset-options", SBM,
            "--model", f"{ZOO}:gin_jk", "--model-options", "hidden=6,layers=2,dropout=0.0",
            "--eval-every", "2",
            "--out", str(tmp_path / out), "--quiet", "--dtype", "float64", *extra]  # fmt: skip
    assert main(argv) == 0


def test_a_user_model_trains_resumes_on_another_grid_and_goes_back_home(tmp_path, capsys):
    """2 ranks on x=2 for 4 epochs, resumed on y=2 to 6; the same 6 epochs straight on one
    rank give the same parameters to rounding; the consolidated checkpoint loads into the
    user's class with strict=True and predicts what the trainer predicted."""

    _train(tmp_path, "a", "--epochs", "4", "--nprocs", "2", "--grid", "x=2")
    _train(tmp_path, "a", "--epochs", "6", "--nprocs", "2", "--grid", "y=2", "--resume")
    _train(tmp_path, "b", "--epochs", "6")
    from gnnpar.models.fullgraph.task import FullGraphConfig
    from gnnpar.train.loop import load_dataset

    graph = load_dataset(FullGraphConfig(dataset="sbm", dataset_options=SBM))
    model = zoo().gin_jk(5, 3, hidden=6, layers=2, dropout=0.0).double()
    _goes_home(tmp_path, model, graph, lambda m: m(graph.feat.double(), _plain_edge_index(graph)))


def _goes_home(tmp_path: Path, model: nn.Module, graph, logits_of) -> None:
    """Run ``a`` (resumed on another grid) equals the straight run ``b``; its consolidated
    checkpoint loads into the user's ``model`` with strict=True, and ``gnnpar predict`` gives
    the argmax of the model's logits (``logits_of(model)``) on every node with a class."""
    from gnnpar.checkpoint import consolidate
    from gnnpar.cli import main

    got, want = consolidate(tmp_path / "a"), consolidate(tmp_path / "b")
    assert sorted(got) == sorted(want)
    for key in want:
        _close(got[key].double(), want[key].double(), 0.0, key)
    model.load_state_dict(got, strict=True)
    model.eval()
    pred_dir = tmp_path / "pred"
    argv = ["predict", str(tmp_path / "a"), "--checkpoint", "latest", "--out", str(pred_dir)]
    assert main(argv) == 0
    predicted = torch.from_numpy(np.load(pred_dir / "predictions.npy")).long()
    with torch.no_grad():
        plain = logits_of(model).argmax(1)
    target = graph.ndata["label"] >= 0  # a typed graph's other types have no class
    assert predicted.shape[0] == graph.num_nodes
    assert torch.equal(predicted[target], plain[target])
    if graph.types is not None:  # the other types' nodes: -1, no class
        assert (predicted[~target] == -1).all()


MAG = "num_papers=120,num_authors=60,num_institutions=5,num_fields=8,num_classes=3,feat_dim=6"


def test_a_users_rgcn_trains_on_a_typed_graph_resumes_and_goes_back_home(tmp_path):
    """The example's R-GCN (its factory takes ``num_relations``: the trainer cuts the
    relations' shards and passes the graph's) on a small mag-synth, its featureless rows
    learnt, 3 epochs on x=2 resumed on y=2 to 5, equals 5 epochs on one rank, the learnt
    table too; the consolidated checkpoint loads into the user's class with strict=True
    and, on the features with each featureless type's learnt table, predicts what the
    trainer predicted."""
    from gnnpar.checkpoint import consolidate_inputs
    from gnnpar.cli import main
    from gnnpar.models.fullgraph.embedding import consolidated_embeddings
    from gnnpar.models.fullgraph.task import FullGraphConfig
    from gnnpar.train.loop import load_dataset

    def train(out: str, *extra: str) -> None:
        argv = ["train", "gcn", "--dataset", "mag-synth", "--dataset-options", MAG,
                "--model", f"{ZOO}:rgcn", "--model-options", "hidden=5,dropout=0.0",
                "--eval-every", "2", "--out", str(tmp_path / out), "--quiet",
                "--dtype", "float64", "--featureless", "learn", *extra]  # fmt: skip
        assert main(argv) == 0

    train("a", "--epochs", "3", "--nprocs", "2", "--grid", "x=2")
    train("a", "--epochs", "5", "--nprocs", "2", "--grid", "y=2", "--resume")
    train("b", "--epochs", "5")
    got, want = consolidate_inputs(tmp_path / "a"), consolidate_inputs(tmp_path / "b")
    assert sorted(got) == ["inputs.embedding", "inputs.node_ids"]
    for key in want:
        _close(got[key].double(), want[key].double(), 0.0, key)
    graph = load_dataset(FullGraphConfig(dataset="mag-synth", dataset_options=MAG))
    x = graph.feat.double()
    types = graph.types
    for name, table in consolidated_embeddings(tmp_path / "a", types).items():
        lo, hi = types.id_range(name)
        x[lo:hi] = table
    model = zoo().rgcn(6, 3, types.num_relations, hidden=5, dropout=0.0).double()
    edges = (torch.stack(graph.edges()), types.edge_type)
    _goes_home(tmp_path, model, graph, lambda m: m(x, *edges))


# ---------------------------------------------------------------------------- mini-batch
def _sbm(weighted: bool = False):
    from gnnpar.data import sbm

    g = sbm(num_nodes=90, feat_dim=FEAT, num_classes=CLASSES, avg_degree=6.0, seed=4)
    g.ndata["feat"] = g.feat.double()
    return g


def _plain_edge_index(g) -> torch.Tensor:
    return torch.stack(g.edges())


def test_a_batch_subgraph_is_every_sampled_edge_once_and_the_model_runs_on_it():
    """The subgraph of a sampled batch holds exactly the blocks' edges (as global pairs),
    its first rows are the seeds, and the seeds' logits are the plain model's on it."""
    from gnnpar.models.minibatch.pyg import subgraph_edges, subgraph_logits
    from gnnpar.sampling import NeighborSampler

    g = _sbm()
    batch = NeighborSampler(g, [3, 2], seed=1).sample(torch.tensor([5, 17, 40, 41]))
    nodes = batch.blocks[0].src_nodes
    edge_index, edge_type = subgraph_edges(batch.blocks)
    assert edge_type is None  # an untyped graph's blocks
    got = {(int(nodes[s]), int(nodes[d])) for s, d in edge_index.T}
    want = set()
    for b in batch.blocks:
        for s, d in b.edge_index.T:
            want.add((int(b.src_nodes[s]), int(b.src_nodes[d])))
    assert got == want and edge_index.shape[1] == len(want)
    assert torch.equal(nodes[: batch.blocks[-1].num_dst], batch.seeds)
    torch.manual_seed(0)
    model = zoo().gatv2_residual(FEAT, CLASSES, hidden=6, heads=2, layers=2, dropout=0.0)
    model = model.double().eval()
    x = g.feat[nodes]
    ours = subgraph_logits(model, batch.blocks, x)
    theirs = model(x, edge_index)[: len(batch.seeds)]
    assert torch.equal(ours, theirs)


def _two_relations_on_a_pair():
    """A typed graph where pairs of papers are joined by two relations (cites and
    extends), with a duplicate edge and a self loop: 7 papers (4 features), 3 authors."""
    from gnnpar.graph.typed import typed_graph

    t = torch.tensor
    edges = {
        ("paper", "cites", "paper"): (t([0, 1, 2, 3, 4, 6, 5]), t([1, 2, 3, 4, 5, 5, 5])),
        ("paper", "extends", "paper"): (t([0, 2, 4, 6, 6]), t([1, 3, 5, 6, 0])),
        ("author", "writes", "paper"): (t([0, 1, 2, 2, 0]), t([0, 1, 5, 5, 6])),
        ("paper", "rev_writes", "author"): (t([0, 1, 5, 5, 6]), t([0, 1, 2, 2, 0])),
    }
    features = {"paper": torch.randn(7, 4, generator=torch.Generator().manual_seed(3),
                                     dtype=torch.float64)}  # fmt: skip
    ndata = {"label": t([0, 1, 2, 0, 1, 2, 0]), "train_mask": torch.ones(7, dtype=torch.bool)}
    return typed_graph({"paper": 7, "author": 3}, edges, features, "paper", ndata,
                       num_classes=3)  # fmt: skip


def test_a_typed_batch_subgraph_keeps_each_relation_of_a_pair():
    """On a typed graph's blocks the subgraph holds every sampled (source, destination,
    relation) once, two relations between one pair as two edges, and a user's R-GCN or
    RGAT (``model(x, edge_index, edge_type)``) gives the seeds' rows of the plain model on
    it; the whole graph's inputs are every edge with its relation."""
    from gnnpar.models.minibatch.pyg import graph_inputs, subgraph_edges, subgraph_logits
    from gnnpar.sampling import NeighborSampler

    g = _two_relations_on_a_pair()
    rels = g.types.num_relations
    batch = NeighborSampler(g, [-1, -1], seed=1).sample(
        g.types.global_ids("paper", torch.tensor([1, 5]))
    )
    nodes = batch.blocks[0].src_nodes
    edge_index, edge_type = subgraph_edges(batch.blocks)
    got = [
        (int(nodes[s]), int(nodes[d]), int(r))
        for (s, d), r in zip(edge_index.T, edge_type, strict=True)
    ]
    want = set()
    for b in batch.blocks:
        for (s, d), r in zip(b.edge_index.T, b.edge_type, strict=True):
            want.add((int(b.src_nodes[s]), int(b.src_nodes[d]), int(r)))
    assert sorted(got) == sorted(want) and len(got) == len(set(got))
    pairs = [(s, d) for s, d, _ in got]
    assert len(set(pairs)) < len(pairs)  # a pair joined by two relations is two edges
    x = g.feat[nodes]
    for make in (lambda: zoo().rgcn(4, 3, rels, hidden=5, dropout=0.0),
                 lambda: zoo().rgat(4, 3, rels, hidden=3, heads=2, dropout=0.0)):  # fmt: skip
        torch.manual_seed(0)
        model = make().double().eval()
        seeds = batch.blocks[-1].num_dst
        assert torch.equal(subgraph_logits(model, batch.blocks, x, relational=True),
                           model(x, edge_index, edge_type)[:seeds])  # fmt: skip
    whole = graph_inputs(g, torch.device("cpu"), relational=True)
    assert torch.equal(whole[0], torch.stack(g.edges())) and torch.equal(
        whole[1], g.types.edge_type
    )
    with pytest.raises(UserError, match="needs a typed graph's relations"):
        graph_inputs(_sbm(), torch.device("cpu"), relational=True)


def _part_world(folder: str, typed_folder: str) -> int:
    import gnnpar
    from gnnpar.models.minibatch.pyg import part_logits
    from gnnpar.sampling import LocalPart

    grid = gnnpar.init()
    checked = _typed_part_check(grid, typed_folder)
    part = LocalPart.load(folder, grid.rank("data"))
    part.ndata["feat"] = part.ndata["feat"].double()
    g = _sbm()
    edge_index = _plain_edge_index(g)
    ids = part.orig_ids[: part.num_owned].long()
    for name, make in cases(zoo()).items():
        torch.manual_seed(0)
        model = make().double()
        model.train()
        model(g.feat, edge_index)  # one training pass: BatchNorm's running statistics move
        model.eval()
        want = model(g.feat, edge_index)[ids]
        got = part_logits(model, part, grid)
        _close(got, want.detach(), 0.0, f"{name} on part {part.part_id}")
        assert model(g.feat, edge_index).shape == (g.num_nodes, CLASSES)  # forwards removed
        checked += 1
    gnnpar.release(grid)
    return checked


def _typed_part_check(grid, folder: str) -> int:
    """The typed cases (R-GCNs and RGATs) on a part of the small typed graph: the owned
    nodes' logits, each relation's mean and the attention's softmax over the part's block
    of in-edges, equal the plain model with every edge's relation."""
    from gnnpar.models.minibatch.pyg import part_logits
    from gnnpar.sampling import LocalPart
    from tests.fullgraph_utils import small_typed_graph

    part = LocalPart.load(folder, grid.rank("data"))
    part.ndata["feat"] = part.ndata["feat"].double()
    g = small_typed_graph()
    rels = g.types.num_relations
    edges = (_plain_edge_index(g), g.types.edge_type)
    ids = part.orig_ids[: part.num_owned].long()
    for name, make in typed_cases(zoo(), rels).items():
        torch.manual_seed(0)
        model = make().double().eval()
        want = model(g.feat, *edges)[ids]
        got = part_logits(model, part, grid, relational=True)
        _close(got, want.detach(), 0.0, f"{name} on typed part {part.part_id}")
    return len(typed_cases(zoo(), rels))


def test_distributed_inference_of_a_user_model_is_the_full_graph_model(tmp_path):
    """Three parts (one per rank): each rank's logits of its owned nodes, through halo
    exchanges before every aggregation, equal the plain model on the whole graph; so do a
    user's R-GCNs and RGATs on three parts of a typed graph (the relations' operators of
    each part's block)."""
    import partitioners
    from gnnpar.testing import run_distributed
    from tests.fullgraph_utils import small_typed_graph

    folders = []
    for name, g in (("parts", _sbm()), ("typed-parts", small_typed_graph())):
        part = partitioners.partition(g, 3, method="metis", seed=0)
        partitioners.write(g, part, tmp_path / name, halo=1)
        folders.append(str(tmp_path / name))
    counts = run_distributed(_part_world, 3, *folders, timeout=600)
    assert counts == [len(cases(zoo())) + len(typed_cases(zoo(), 5))] * 3


def test_a_user_model_trains_mini_batch_on_two_parts_and_predicts_exactly(tmp_path):
    """``gnnpar train sage --model FILE:FACTORY`` on 2 ranks (distributed sampling over 2
    parts, data parallel): the consolidated checkpoint loads into the user's class with
    strict=True, and ``gnnpar predict`` (full-neighbour inference over the parts) gives
    the plain model's full-graph predictions."""
    from gnnpar.checkpoint import consolidate
    from gnnpar.cli import main
    from gnnpar.models.minibatch.task import MiniBatchConfig
    from gnnpar.train.loop import load_dataset

    run = tmp_path / "run"
    argv = ["train", "sage", "--dataset", "sbm", "--dataset-options", SBM,
            "--model", f"{ZOO}:gatv2_residual", "--model-options", "hidden=6,heads=2,layers=2",
            "--fanouts", "4,3", "--batch-size", "16", "--epochs", "2", "--dtype", "float64",
            "--nprocs", "2", "--out", str(run), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    model = zoo().gatv2_residual(5, 3, hidden=6, heads=2, layers=2).double()
    model.load_state_dict(consolidate(run), strict=True)
    model.eval()
    assert main(["predict", str(run), "--checkpoint", "latest", "--out", str(tmp_path / "p")]) == 0
    predicted = torch.from_numpy(np.load(tmp_path / "p" / "predictions.npy"))
    graph = load_dataset(MiniBatchConfig(dataset="sbm", dataset_options=SBM))
    with torch.no_grad():
        plain = model(graph.feat.double(), _plain_edge_index(graph)).argmax(1)
    assert torch.equal(predicted.long(), plain)


def test_a_bad_model_option_is_one_line_before_any_rank_starts(tmp_path, capsys):
    """``--model`` naming no file, no function, a failing call or an unsupported layer: one
    line on stderr and exit code 2, with no rank started (``--nprocs 2``)."""
    from gnnpar.cli import main

    mine = tmp_path / "mine.py"
    mine.write_text(
        "from torch_geometric import nn as gnn\n"
        "def cheb(in_channels, out_channels):\n"
        "    return gnn.ChebConv(in_channels, out_channels, K=2)\n"
        "def broken(in_channels, out_channels):\n"
        "    return 1 / 0\n"
    )
    cases = {
        f"{tmp_path}/none.py:f": "no file",
        f"{mine}:nosuch": "has no function 'nosuch'",
        f"{mine}:cheb": "ChebConv at the model itself is a message-passing layer",
        f"{ZOO}:gcn --model-options nosuch=1": "unexpected keyword argument 'nosuch'",
    }
    for model, words in cases.items():
        argv = ["train", "gcn", "--dataset", "sbm", "--nprocs", "2", "--out",
                str(tmp_path / "run"), "--model", *model.split()]  # fmt: skip
        assert main(argv) == 2, model
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert not (tmp_path / "run").exists()
    argv = ["train", "gcn", "--dataset", "sbm", "--out", str(tmp_path / "run"), "--model",
            f"{mine}:broken"]  # fmt: skip
    with pytest.raises(ZeroDivisionError):  # the user's own bug: its traceback, as any bug's
        main(argv)


def test_a_user_models_dropout_is_a_function_of_the_step_and_rank():
    """The same dropout seed draws the same masks (a resumed step repeats its epoch), another
    seed other masks, and the global generator is left as it was."""
    import gnnpar
    from gnnpar.models.fullgraph.pyg import parallelize_pyg

    grid = gnnpar.init()
    _, source = _small_source()
    torch.manual_seed(0)
    par = parallelize_pyg(zoo().gcn(FEAT, CLASSES, hidden=6, dropout=0.5).double(), grid, source)
    x = par.input_features()
    state = torch.random.get_rng_state()
    a, b, c = par(x, dropout_seed=7), par(x, dropout_seed=7), par(x, dropout_seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.random.get_rng_state(), state)
    gnnpar.release(grid)
