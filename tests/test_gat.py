"""GAT: the serial model against PyG's ``GATConv`` (same weights, eval mode: logits and every
gradient), its attention dropout drawn from (seed, edge, head) alone. GAT and GIN on every
grid against the serial model, the trainer and the planner. Edge weights: the serial weighted
GAT against a written-out attention, GIN against DGL's weighted ``GINConv``, the block layers
against the full-graph ones on a full-neighbourhood sample, all-ones weights against none
(bit for bit), and a shard folder without the weights refused.

Float64 throughout; tiny graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gnnpar.models.fullgraph.model import GAT, FullGraphGNN
from gnnpar.nn.dropout import edge_dropout
from tests.fullgraph_utils import normalise, serial_adj, small_graph

N = 23
DIMS = [7, 6, 3]  # 3 heads of 2 hidden features, 2 averaged output heads of 3 classes


def gat_model(dims=DIMS, heads=3, out_heads=2, attn_dropout=0.0, dropout=0.0, seed=0):
    """A float64 GAT with non-trivial biases."""
    torch.manual_seed(seed)
    m = FullGraphGNN(
        dims[0], dims[1], dims[-1], len(dims) - 1, dropout, "gat",
        heads=heads, out_heads=out_heads, attn_dropout=attn_dropout,
    ).double()  # fmt: skip
    with torch.no_grad():
        for layer in m.layers:
            layer.bias.normal_()
    return m


@pytest.mark.parametrize("pieces", ["one", "many"])
def test_serial_gat_equals_pyg_gatconv_forward_and_gradients(pieces, monkeypatch):
    gnn = pytest.importorskip("torch_geometric.nn")
    if pieces == "many":  # the attention gradient in pieces of 5 edges (a real graph's path)
        from gnnpar.sparse import attention

        monkeypatch.setattr(attention, "_SDDMM_EDGES", 5)
    a, x, y, train = small_graph(n=N, feat=DIMS[0])
    model = gat_model()
    model.eval()
    convs = []
    for i, layer in enumerate(model.layers):
        conv = gnn.GATConv(DIMS[i], layer.head_dim, heads=layer.heads, concat=layer.concat).double()
        with torch.no_grad():
            conv.lin.weight.copy_(layer.weight.T)
            conv.att_src.copy_(layer.att_src[None])
            conv.att_dst.copy_(layer.att_dst[None])
            conv.bias.copy_(layer.bias)
        conv.eval()
        convs.append(conv)
    edge_index = a.nonzero().T  # (source, target) pairs; GATConv adds the self loops
    xr, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = model(serial_adj(normalise(a, "raw")), xr)
    theirs = F.elu(convs[0](xp, edge_index))
    theirs = convs[1](theirs, edge_index)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    F.cross_entropy(ours[train], y[train]).backward()
    F.cross_entropy(theirs[train], y[train]).backward()
    torch.testing.assert_close(xr.grad, xp.grad, rtol=1e-12, atol=1e-12)
    for layer, conv in zip(model.layers, convs, strict=True):
        torch.testing.assert_close(
            layer.weight.grad, conv.lin.weight.grad.T, rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(layer.att_src.grad, conv.att_src.grad[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.att_dst.grad, conv.att_dst.grad[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.bias.grad, conv.bias.grad, rtol=1e-12, atol=1e-12)


def test_gat_preset_and_shapes():
    m = GAT(7, 64, 3)
    assert m.kind == "gat" and m.dims == [7, 64, 3] and m.dropout == 0.6
    assert [(layer.heads, layer.head_dim, layer.concat) for layer in m.layers] == [
        (8, 8, True),
        (1, 3, False),
    ]
    with pytest.raises(ValueError, match="cannot split into 3 heads"):
        FullGraphGNN(7, 8, 3, kind="gat", heads=3)


def test_attention_dropout_depends_on_seed_edge_and_head_only():
    att = torch.ones(6, 4, dtype=torch.float64)
    dst = torch.tensor([0, 0, 1, 2, 2, 5])
    src = torch.tensor([0, 3, 1, 2, 4, 5])
    full = edge_dropout(att, 0.5, 7, dst, src)
    # the same edges in another order and split in two pieces draw the same mask
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    part = torch.cat(
        [edge_dropout(att[order[:2]], 0.5, 7, dst[order[:2]], src[order[:2]]),
         edge_dropout(att[order[2:]], 0.5, 7, dst[order[2:]], src[order[2:]])]
    )  # fmt: skip
    torch.testing.assert_close(part, full[order], rtol=0, atol=0)
    assert set(full.unique().tolist()) <= {0.0, 2.0}
    assert not torch.equal(full, edge_dropout(att, 0.5, 8, dst, src))  # the seed matters
    assert not torch.equal(full[:, 0], full[:, 1])  # so does the head
    assert not torch.equal(full, edge_dropout(att, 0.5, 7, src, dst))  # and the direction
    big = edge_dropout(torch.ones(20000, 2, dtype=torch.float64), 0.6, 1,
                       torch.arange(20000), torch.arange(20000) * 7)  # fmt: skip
    assert abs((big == 0).double().mean().item() - 0.6) < 0.02


# ------------------------------------------------------------------- 1D and 3D vs serial
DDIMS = [7, 9, 9, 5]  # three layers (every role rotation); nothing divides the grids
DHEADS = [3, 3, 2]  # 3 heads of 3 hidden features, 2 averaged output heads


def _close(a, b, what, tol=1e-12):
    if a.shape != b.shape or not torch.allclose(a, b, atol=tol, rtol=tol):
        diff = (a - b).abs().max() if a.shape == b.shape else (a.shape, b.shape)
        raise AssertionError(f"{what}: max diff {diff}")


def _gin_model(seed: int = 0, dropout: float = 0.0, batch_norm: bool = True):
    """A float64 GIN with non-trivial biases, ε and BatchNorm scales and shifts."""
    from gnnpar.models.fullgraph.model import GIN

    torch.manual_seed(seed)
    m = GIN(DDIMS[0], DDIMS[1], DDIMS[-1], len(DDIMS) - 1, dropout, batch_norm).double()
    with torch.no_grad():
        for layer in m.layers:
            layer.bias.normal_()
            layer.eps.uniform_(-0.5, 0.5)
            if batch_norm:
                layer.norm_weight.uniform_(0.5, 2.0)
                layer.norm_bias.normal_()
            else:
                layer.hidden_bias.normal_()
    return m


def _check(
    kind: str, shape: dict, algorithm: str, permute: bool, seed, weighted=False, batch_norm=True
) -> None:
    import gnnpar
    from gnnpar import comm
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from tests.byte_formulas import gat1d_bytes, gat2d_bytes, gat3d_bytes, gin_bytes
    from tests.fullgraph_utils import check_schedule, make_source

    grid = gnnpar.init(**shape)
    a, x, y, train = small_graph(n=N, feat=DDIMS[0], weighted=weighted)
    a_hat = normalise(a, "raw")
    drop = 0.5 if seed is not None else 0.0
    if kind == "gat":
        ref = gat_model(DDIMS, DHEADS[0], DHEADS[-1], attn_dropout=drop, dropout=drop)
    else:
        ref = _gin_model(dropout=drop, batch_norm=batch_norm)
    ref.train()
    xr = x.clone().requires_grad_(True)
    logits = ref(serial_adj(a_hat), xr, dropout_seed=seed)
    loss_ref = F.cross_entropy(logits[train], y[train])
    loss_ref.backward()

    source = make_source(a_hat, x, y, train, permute, norm="raw")
    par = parallelize_fullgraph(ref, grid, source, algorithm=algorithm)
    par.train()
    xl = par.input_features().requires_grad_(True)
    with comm.record(grid) as fwd:
        out = par(xl, dropout_seed=seed)
    rows, cols = par.logits_rows, par.logits_cols
    ids = source.node_ids(par.output_order, rows)
    tag = f"{grid.describe()} {kind} {algorithm} permute={permute} seed={seed} w={weighted}"
    tag += "" if kind == "gat" else f" batch_norm={batch_norm}"
    _close(out.detach(), logits.detach()[ids][:, cols[0] : cols[1]], f"logits {tag}")
    loss = par.loss(out)
    _close(loss.detach(), loss_ref.detach(), f"loss {tag}")
    with comm.record(grid) as bwd:
        loss.backward()
    full = par.full_weights(grads=True)
    for i, layer in enumerate(ref.layers):
        names = [k for k, _ in layer.named_parameters()]
        assert sorted(full[i]) == sorted(names), (full[i].keys(), names)
        for key in names:
            got = full[i][key].reshape(getattr(layer, key).shape)
            _close(got, getattr(layer, key).grad, f"{key} grad {i} {tag}")
    in_rows, in_cols = par.input_block
    in_ids = source.node_ids(0, in_rows)
    _close(xl.grad, xr.grad[in_ids][:, in_cols[0] : in_cols[1]], f"input grad {tag}")

    es, coords = 8, grid.coords()
    if kind == "gin":
        want_f, want_b = gin_bytes(algorithm, grid.shape, coords, N, DDIMS, es, True, batch_norm)
    elif algorithm == "3d":
        want_f, want_b = gat3d_bytes(grid.shape, coords, N, DDIMS, DHEADS, es, True)
    elif algorithm == "2d":
        want_f, want_b = gat2d_bytes(grid.shape, coords, N, DDIMS, DHEADS, es, True)
    else:
        want_f, want_b = gat1d_bytes(grid.size("tensor"), N, DDIMS, DHEADS, es, True)
    want_f.check(fwd.as_dict(), f"forward bytes {tag}")
    want_b.check(bwd.as_dict(), f"backward bytes {tag}")
    check_schedule(fwd, bwd, par.expected_bytes(), tag)
    gnnpar.release(grid)


def _gat_world(world: int) -> int:
    from gnnpar.testing import grid_shapes

    n = 0
    shapes = [("3d", s) for s in grid_shapes(world)] + [("1d", {"x": world})]
    shapes += [("2d", s) for s in grid_shapes(world, ("x", "y"))]
    for k, (algorithm, shape) in enumerate(shapes):
        # each kind plain on every other shape and permuted with dropout on the rest
        plain, permuted = (False, None), (True, 11)
        configs = (plain, permuted) if k % 2 == 0 else (permuted, plain)
        for kind, (permute, seed) in zip(("gat", "gin"), configs, strict=True):
            # at 8 ranks the permuted cases run on a weighted graph
            _check(kind, shape, algorithm, permute, seed, weighted=world == 8 and permute)
            n += 1
    # GIN without its BatchNorm, permuted with dropout, on the first shape of each layout
    for algorithm in ("3d", "2d", "1d"):
        shape = next(s for a, s in shapes if a == algorithm)
        _check("gin", shape, algorithm, True, 11, batch_norm=False)
        n += 1
    return n


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_gat_and_gin_match_serial_on_every_grid(world):
    """Every x·y·z shape of the world (3D), every x·y shape (2D) and the 1D rows, GAT and
    GIN: logits, loss and every gradient equal the serial model to 1e-12 in float64 (each
    kind plain on half the shapes, permuted with feature and attention dropout on the
    others, on a weighted graph at 8 ranks; GIN's BatchNorm statistics over the rows of
    every rank along the rows' axis, and GIN without the BatchNorm once per layout), and the
    bytes of each pass equal the schedule and the written formulas."""
    from gnnpar.testing import grid_shapes, run_distributed

    counts = run_distributed(_gat_world, world, world, timeout=600)
    shapes = len(grid_shapes(world)) + 1 + len(grid_shapes(world, ("x", "y")))
    assert counts == [2 * shapes + 3] * world


# -------------------------------------------------------------- the trainer and the planner
def _argv(model: str):
    def argv(out, epochs: int, grid: str, nprocs: int, *extra: str) -> list[str]:
        return ["train", "gcn", "--model", model, "--heads", "3", "--out-heads", "2",
                "--dataset", "sbm", "--dataset-options", "num_nodes=90,feat_dim=6",
                "--root", str(out.parent / "data"), "--layers", "3", "--hidden", "6",
                "--dtype", "float64", "--epochs", str(epochs), "--grid", grid, "--nprocs",
                str(nprocs), "--out", str(out), "--eval-every", "0", "--quiet",
                "--blocks", "3", *extra]  # fmt: skip

    return argv


def test_train_gat_and_gin_resume_on_another_grid_and_match_one_rank(tmp_path, monkeypatch):
    """``gnnpar train gcn --model gat|gin`` (feature and attention dropout on), on one world
    of 4 ranks: saved on x=2,z=2, resumed on y=4 equals a straight run there, which equals a
    straight run on one rank (float64 parameters after 4 Adam steps, ≤ 1e-10 relative, the
    issue's bound for loss curves; measured 3.5e-12 (gat): the masks depend on (seed, node
    or edge, feature or head), not on the grid)."""
    from gnnpar.cli import main
    from tests.cli_world import run_commands
    from tests.test_checkpoint_train import _same

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    steps = []
    for model in ("gat", "gin"):
        argv, d = _argv(model), tmp_path / model
        steps += [argv(d / "saved", 2, "x=2,z=2", 4), ("copy", d / "saved", d / "resumed"),
                  argv(d / "resumed", 4, "y=4", 4, "--resume"),
                  argv(d / "straight", 4, "y=4", 4)]  # fmt: skip
    assert run_commands(4, steps) == [[0] * 6] * 4
    for model in ("gat", "gin"):
        d = tmp_path / model
        err = _same(d / "resumed", d / "straight")
        assert err <= 1e-10, f"{model} resumed on y=4: {err:.3g}"
        assert main(_argv(model)(d / "one", 4, "x=1", 1)) == 0
        err = _same(d / "one", d / "straight")
        assert err <= 1e-10, f"{model} on one rank vs y=4: {err:.3g}"


def test_train_gat_options_are_checked():
    from gnnpar.models.fullgraph.task import FullGraphConfig
    from gnnpar.train.config import ConfigError

    with pytest.raises(ConfigError, match="'hidden' \\(10\\) must be a multiple of 'heads'"):
        FullGraphConfig(model="gat", hidden=10, heads=3).check()
    with pytest.raises(ConfigError, match="'attn_dropout' must be in"):
        FullGraphConfig(model="gat", attn_dropout=1.0).check()
    with pytest.raises(ConfigError, match="must be one of gcn, sage, gat, gin"):
        FullGraphConfig(model="gin2").check()


def test_planner_gat_and_gin_bytes_equal_the_written_formulas_and_count_attention_memory():
    """The planner's GAT and GIN (``gnnpar plan gcn --model gat|gin``): the bytes of an
    uneven shape (GAT every rank, GIN one) equal the formulas written in
    tests/byte_formulas.py (loss left out), and GAT's memory holds the per-edge, per-head
    attention tensors, growing with the heads."""
    from gnnpar.models.fullgraph.cost import GCNProblem, gcn_collectives
    from gnnpar.models.fullgraph.memory import gcn_memory
    from tests.byte_formulas import gat3d_bytes, gin_bytes

    dims, heads = [37, 12, 12, 5], [4, 4, 3]
    problem = GCNProblem.from_widths(1001, 5000, dims, model="gat", heads=4, out_heads=3)
    shape = {"x": 3, "y": 2, "z": 1, "data": 1}
    for rank in range(6):
        coords = {"x": rank % 3, "y": rank // 3, "z": 0, "data": 0}
        colls = gcn_collectives(problem, shape, coords, loss=False)
        got: dict[str, dict[str, int]] = {}
        for c in colls:
            got.setdefault(c.axis, {}).setdefault(c.kind, 0)
            got[c.axis][c.kind] += c.total
        f, b = gat3d_bytes(shape, coords, 1001, dims, heads, 4, True)
        both = f
        for axis, kinds in b.bytes.items():
            for kind, v in kinds.items():
                both.bytes[axis][kind] += v
                both.calls[axis][kind] += b.calls[axis][kind]
        both.check(got, f"planner gat rank {rank}")
    gin = GCNProblem.from_widths(1001, 5000, dims, model="gin")
    colls = gcn_collectives(gin, shape, {"x": 2, "y": 1, "z": 0, "data": 0}, loss=False)
    got = {}
    for c in colls:
        got.setdefault(c.axis, {}).setdefault(c.kind, 0)
        got[c.axis][c.kind] += c.total
    f, b = gin_bytes("3d", shape, {"x": 2, "y": 1, "z": 0}, 1001, dims, 4, True)
    for axis, kinds in b.bytes.items():
        for kind, v in kinds.items():
            f.bytes[axis][kind] += v
            f.calls[axis][kind] += b.calls[axis][kind]
    f.check(got, "planner gin")
    mem = gcn_memory(problem, shape)
    more = gcn_memory(GCNProblem.from_widths(1001, 5000, dims, model="gat", heads=6), shape)
    assert mem["attention"] > 0 and more["attention"] > mem["attention"]
    assert "attention" not in gcn_memory(GCNProblem.from_widths(1001, 5000, dims), shape)


def _hidden_pairs(layer, mlp, batch_norm: bool) -> list:
    """(ours, theirs) of the BatchNorm's scale and shift, or without it the first bias."""
    if not batch_norm:
        return [(layer.hidden_bias, mlp[0].bias)]
    return [(layer.norm_weight, mlp[1].weight), (layer.norm_bias, mlp[1].bias)]


def _mlp(d_in: int, d_out: int, batch_norm: bool) -> torch.nn.Sequential:
    """PyG's GIN MLP: Linear → BatchNorm (batch statistics in both modes) → ReLU → Linear,
    the first Linear without a bias where the BatchNorm's mean would remove it."""
    norm = [torch.nn.BatchNorm1d(d_out, track_running_stats=False)] if batch_norm else []
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, d_out, bias=not batch_norm), *norm, torch.nn.ReLU(),
        torch.nn.Linear(d_out, d_out),
    ).double()  # fmt: skip


@pytest.mark.parametrize("batch_norm", [True, False])
def test_serial_gin_equals_pyg_ginconv_forward_and_gradients(batch_norm):
    """Our GIN (BatchNorm in each MLP, or none) against PyG's ``GINConv`` over the MLP of
    PyG's GIN examples, in training and evaluation mode (the BatchNorm reads the pass's own
    statistics in both): logits and every gradient, float64."""
    gnn = pytest.importorskip("torch_geometric.nn")
    from gnnpar.models.fullgraph.model import GIN

    a, x, y, train = small_graph(n=N, feat=DIMS[0])
    torch.manual_seed(0)
    model = GIN(DIMS[0], 6, 3, num_layers=2, dropout=0.0, batch_norm=batch_norm).double()
    with torch.no_grad():
        for layer in model.layers:
            layer.bias.normal_()
            layer.eps.fill_(0.3)
            if batch_norm:
                layer.norm_weight.uniform_(0.5, 2.0)
                layer.norm_bias.normal_()
            else:
                layer.hidden_bias.normal_()
    convs = []
    for i, layer in enumerate(model.layers):
        conv = gnn.GINConv(_mlp(model.dims[i], model.dims[i + 1], batch_norm), train_eps=True)
        conv = conv.double()  # GINConv resets the MLP: copy after
        with torch.no_grad():
            conv.nn[0].weight.copy_(layer.weight.T)
            conv.nn[-1].weight.copy_(layer.weight_out.T)
            conv.nn[-1].bias.copy_(layer.bias)
            conv.eps.fill_(0.3)
            for ours_p, theirs_p in _hidden_pairs(layer, conv.nn, batch_norm):
                theirs_p.copy_(ours_p)
        convs.append(conv)
    edge_index = a.nonzero().T
    model.eval()
    for conv in convs:
        conv.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(serial_adj(normalise(a, "raw")), x),
            convs[1](torch.relu(convs[0](x, edge_index)), edge_index),
            rtol=1e-12, atol=1e-12,
        )  # fmt: skip
    model.train()
    for conv in convs:
        conv.train()
    xr, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = model(serial_adj(normalise(a, "raw")), xr)
    theirs = convs[1](torch.relu(convs[0](xp, edge_index)), edge_index)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    F.cross_entropy(ours[train], y[train]).backward()
    F.cross_entropy(theirs[train], y[train]).backward()
    torch.testing.assert_close(xr.grad, xp.grad, rtol=1e-12, atol=1e-12)
    for layer, conv in zip(model.layers, convs, strict=True):
        pairs = [(layer.weight.grad, conv.nn[0].weight.grad.T),
                 (layer.weight_out.grad, conv.nn[-1].weight.grad.T),
                 (layer.bias.grad, conv.nn[-1].bias.grad),
                 (layer.eps.grad, conv.eps.grad)]  # fmt: skip
        pairs += [(o.grad, t.grad) for o, t in _hidden_pairs(layer, conv.nn, batch_norm)]
        for ours_g, theirs_g in pairs:
            torch.testing.assert_close(
                ours_g, theirs_g.reshape(ours_g.shape), rtol=1e-12, atol=1e-12
            )


# ------------------------------------------------------------------------- edge weights
def _graph_of(a: torch.Tensor, x: torch.Tensor, weighted: bool = True):
    """The Graph whose row i lists j with weight ``a[i, j]`` (unweighted: the structure)."""
    from gnnpar.graph import Graph

    i, j = a.nonzero(as_tuple=True)
    w = a[i, j] if weighted else None
    return Graph.from_edges(j, i, num_nodes=a.shape[0], edge_weight=w, ndata={"feat": x})


def from_csr(graph):
    """The whole (normalised) graph as one CSR block."""
    from gnnpar.sparse.csr import CSRBlock

    n = graph.num_nodes
    return CSRBlock(graph.indptr, graph.indices, graph.edge_weight, (n, n))


def _dense_gat(layer, h: torch.Tensor, a_raw: torch.Tensor) -> torch.Tensor:
    """A GAT layer written out densely: per head ``α_ij = w_ij exp(e_ij) / Σ_k w_ik
    exp(e_ik)`` over the nonzeros of the raw ``A + I`` (w: its entries)."""
    n = h.shape[0]
    z = (h @ layer.weight).view(n, layer.heads, layer.head_dim)
    s_dst, s_src = (z * layer.att_dst).sum(-1), (z * layer.att_src).sum(-1)
    e = F.leaky_relu(s_dst[:, None, :] + s_src[None, :, :], layer.negative_slope)
    num = a_raw[:, :, None] * torch.exp(e)  # 0 off the structure
    out = torch.einsum("ijk,jkf->ikf", num / num.sum(1, keepdim=True), z)
    out = out.reshape(n, -1) if layer.concat else out.mean(1)
    return out + layer.bias


def _grads(out, train, y, tensors):
    return torch.autograd.grad(F.cross_entropy(out[train], y[train]), tensors)


def test_weighted_serial_gat_equals_the_written_out_attention():
    """α ∝ w·exp(e) over A + I (self loops weigh 1): logits and every gradient, float64.
    Against a dense write-out, not a library: PyG's ``GATConv`` adds a linear map of
    ``edge_attr`` before the LeakyReLU, and DGL's scales the attention after the softmax
    without renormalising; neither is this definition (the mini-batch GATConv's)."""
    a, x, y, train = small_graph(n=N, feat=DIMS[0], weighted=True)
    a_raw = normalise(a, "raw")
    model = gat_model()
    model.eval()
    xr = x.clone().requires_grad_(True)
    params = list(model.parameters()) + [xr]
    ours = model(serial_adj(a_raw), xr)
    theirs = _dense_gat(model.layers[1], F.elu(_dense_gat(model.layers[0], xr, a_raw)), a_raw)
    _close(ours, theirs, "weighted GAT logits")
    unweighted = model(serial_adj(normalise((a != 0).double(), "raw")), xr)
    assert (ours - unweighted).abs().max() > 1e-3  # the weights change the attention
    for g_ours, g_theirs in zip(
        _grads(ours, train, y, params), _grads(theirs, train, y, params), strict=True
    ):
        _close(g_ours, g_theirs, "weighted GAT gradient")


def test_weighted_serial_gin_equals_dgl_ginconv_with_edge_weights():
    """``MLP((1 + ε) h_i + Σ_j w_ij h_j)``, the MLP with its BatchNorm: DGL's
    ``GINConv(edge_weight=...)``, float64 (PyG's ``GINConv`` takes no weights and
    ``GINEConv`` sums ``ReLU(h_j + e_ij)``)."""
    dgl = pytest.importorskip("dgl")
    from dgl.nn import GINConv

    a, x, y, train = small_graph(n=N, feat=DIMS[0], weighted=True)
    model = _gin_model()
    i, j = a.nonzero(as_tuple=True)
    graph = dgl.graph((j, i), num_nodes=N)  # message j -> i with weight a[i, j]
    convs = []
    for k, layer in enumerate(model.layers):
        mlp = _mlp(model.dims[k], model.dims[k + 1], batch_norm=True)
        conv = GINConv(mlp, "sum", learn_eps=True).double()
        with torch.no_grad():
            conv.eps.copy_(layer.eps)
            mlp[0].weight.copy_(layer.weight.T)
            mlp[1].weight.copy_(layer.norm_weight)
            mlp[1].bias.copy_(layer.norm_bias)
            mlp[3].weight.copy_(layer.weight_out.T)
            mlp[3].bias.copy_(layer.bias)
        convs.append(conv)
    xr, xd = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = model(serial_adj(normalise(a, "raw")), xr)
    theirs = xd
    for k, conv in enumerate(convs):
        theirs = conv(graph, theirs, edge_weight=a[i, j])
        theirs = torch.relu(theirs) if k < len(convs) - 1 else theirs
    _close(ours, theirs, "weighted GIN logits")
    mine = [xr] + [p for layer in model.layers for p in
                   (layer.weight, layer.norm_weight, layer.norm_bias, layer.weight_out,
                    layer.bias, layer.eps)]  # fmt: skip
    dgls = [xd] + [p for c in convs for p in
                   (c.apply_func[0].weight, c.apply_func[1].weight, c.apply_func[1].bias,
                    c.apply_func[3].weight, c.apply_func[3].bias, c.eps)]  # fmt: skip
    linear = [False] + [True, False, False, True, False, False] * len(convs)  # out × in
    for g_ours, g_dgl, t in zip(
        _grads(ours, train, y, mine), _grads(theirs, train, y, dgls), linear, strict=True
    ):
        _close(g_ours, (g_dgl.T if t else g_dgl).reshape(g_ours.shape), "weighted GIN gradient")


def test_minibatch_layers_with_weights_equal_full_graph_on_a_full_neighbourhood_sample():
    """The sampler records the weights of the edges it samples; BlockGNN (SAGE) on the
    full-neighbourhood blocks of every node, and a GAT block layer, equal the full-graph
    layers on the weighted graph (logits and gradients, float64)."""
    from gnnpar.models.minibatch.model import BlockGNN, GATConv
    from gnnpar.sampling import NeighborSampler
    from gnnpar.sparse.kernels import LocalSpMM

    a, x, y, train = small_graph(n=N, feat=DIMS[0], weighted=True)
    graph = _graph_of(a, x)
    assert torch.equal(graph.to_torch_sparse().to_dense(), a)
    torch.manual_seed(0)
    full = FullGraphGNN(DIMS[0], DIMS[1], DIMS[2], 2, 0.0, "sage").double()
    net = BlockGNN(DIMS[0], DIMS[1], DIMS[2], 2, 0.0, "sage").double()
    with torch.no_grad():
        for f, b in zip(full.layers, net.layers, strict=True):
            f.bias.normal_()
            b.lin_neigh.weight.copy_(f.weight_neigh.T)
            b.lin_root.weight.copy_(f.weight_root.T)
            b.lin_neigh.bias.copy_(f.bias)
    mean = graph.row_normalize()
    adj = LocalSpMM(from_csr(mean))
    batch = NeighborSampler(graph, [-1, -1], backend="torch").sample(torch.arange(N))
    assert all(blk.weight is not None for blk in batch.blocks)
    xf, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours_full = full(adj, xf)
    ours_block = net(batch.blocks, xb[batch.input_nodes])
    _close(ours_block, ours_full, "SAGE block vs full graph")
    gf = _grads(ours_full, train, y, [xf, full.layers[0].weight_neigh, full.layers[1].bias])
    gb = _grads(
        ours_block, train, y, [xb, net.layers[0].lin_neigh.weight, net.layers[1].lin_neigh.bias]
    )
    for f, b, what in zip(gf, gb, ("input", "W_neigh", "bias"), strict=True):
        _close(b.T if b.shape != f.shape else b, f, f"SAGE block vs full graph: {what} grad")

    gat = gat_model().layers[0]  # 3 heads concatenated
    conv = GATConv(DIMS[0], DIMS[1], heads=gat.heads).double()
    with torch.no_grad():
        conv.lin.weight.copy_(gat.weight.T)
        conv.att_src.copy_(gat.att_src)
        conv.att_dst.copy_(gat.att_dst)
        conv.bias.copy_(gat.bias)
    block = NeighborSampler(graph, [-1], backend="torch").sample(torch.arange(N)).blocks[0]
    xf, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours_full = gat(LocalSpMM(from_csr(graph.weighted_self_loops())), xf)
    ours_block = conv(block, xb[block.src_nodes], block.weight)
    _close(ours_block, ours_full, "GAT block vs full graph")
    g = torch.randn_like(ours_full)
    gf = torch.autograd.grad(ours_full, [xf, gat.att_src], g)
    gb = torch.autograd.grad(ours_block, [xb, conv.att_src], g)
    for f, b, what in zip(gf, gb, ("input", "att_src"), strict=True):
        _close(b, f, f"GAT block vs full graph: {what} grad")


def test_all_ones_weights_give_exactly_the_unweighted_result():
    """Every full-graph kind on its adjacency of the graph with all-ones weights, and every
    block model on its sample, equal the unweighted graph's bit for bit."""
    from gnnpar.models.fullgraph.model import NORMS
    from gnnpar.models.minibatch.model import BlockGNN
    from gnnpar.sampling import NeighborSampler
    from gnnpar.sparse.kernels import LocalSpMM

    a, x, _, _ = small_graph(n=N, feat=DIMS[0])
    plain, ones = _graph_of(a, x, weighted=False), _graph_of(a, x)
    assert plain.edge_weight is None and bool((ones.edge_weight == 1).all())

    def adjacency(graph, kind):
        norm = NORMS[kind]
        g = {"gcn": graph.gcn_norm, "mean": graph.row_normalize,
             "raw": graph.weighted_self_loops}[norm]()  # fmt: skip
        return LocalSpMM(from_csr(g))

    for kind in NORMS:
        torch.manual_seed(1)
        model = FullGraphGNN(DIMS[0], 6, 3, 2, 0.0, kind, heads=3).double().eval()
        assert torch.equal(model(adjacency(ones, kind), x), model(adjacency(plain, kind), x)), kind
    for kind in ("sage", "gcn", "gat"):
        torch.manual_seed(1)
        net = BlockGNN(DIMS[0], 6, 3, 2, 0.0, kind, heads=3).double().eval()
        seeds = torch.arange(0, N, 3)
        with_ones = NeighborSampler(ones, [4, 3], seed=2, backend="torch").sample(seeds)
        without = NeighborSampler(plain, [4, 3], seed=2, backend="torch").sample(seeds)
        assert with_ones.blocks[0].weight is not None and without.blocks[0].weight is None
        assert torch.equal(
            net(with_ones.blocks, x[with_ones.input_nodes]),
            net(without.blocks, x[without.input_nodes]),
        ), kind


def test_a_shard_folder_without_the_weights_is_refused_for_gat_and_gin(
    tmp_path, monkeypatch, capsys
):
    """GCN-normalised shards have lost the raw weights GAT and GIN read: one line naming
    the manifest's field; the raw folder is accepted."""
    import gnnpar
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from gnnpar.models.fullgraph.shards import DiskSource, prepare_shards

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    a, x, y, train = small_graph(n=11, feat=4, weighted=True)
    graph = _graph_of(a, x.float())
    graph.ndata.update(label=y, train_mask=train)
    gcn = DiskSource(prepare_shards(graph, tmp_path / "gcn", norm="gcn", blocks=(2, 2)))
    raw = DiskSource(prepare_shards(graph, tmp_path / "raw", norm="raw", blocks=(2, 2)))
    grid = gnnpar.init()
    for kind in ("gat", "gin"):
        model = FullGraphGNN(4, 6, 3, 2, 0.0, kind, heads=3)
        with pytest.raises(ValueError) as err:
            parallelize_fullgraph(model, grid, gcn)
        line = str(err.value)
        assert "\n" not in line and "manifest.json: meta field 'norm' is 'gcn'" in line, line
        assert f"a {kind} model reads the 'raw' adjacency" in line, line
        parallelize_fullgraph(model, grid, raw)  # accepted
    gnnpar.release(grid)
    # the trainer given that folder for a gat model: the same line, as a config error
    from gnnpar.cli import main
    from gnnpar.data import save_graph

    data = save_graph(graph, tmp_path / "graph")
    argv = ["train", "gcn", "--model", "gat", "--dataset", str(data), "--shards",
            str(tmp_path / "gcn"), "--epochs", "1", "--out", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "meta field 'norm' is 'gcn'" in err[0], err
