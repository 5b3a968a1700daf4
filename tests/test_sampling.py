"""Neighbour and vertex sampling, blocks, the loader and layer-wise inference, in one process.

Sampling checks run on a small random graph whose degrees cover every code path of the
sampler: isolated nodes, rows shorter than the fan-out, rows up to 64 (the bitmask path of
Floyd's algorithm) and hubs above 64 (the comparison path).
"""

from __future__ import annotations

import itertools
import re
import threading

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from gnnpar.graph import Graph
from gnnpar.models.minibatch.model import BlockGNN, GATConv, SAGEConv
from gnnpar.sampling import (
    Block,
    NeighborSampler,
    NodeLoader,
    VertexSampler,
    batch_sizes,
    derive_key,
    full_blocks,
    layerwise_inference,
    parse_fanouts,
    uniform_subset,
)

P_MIN = 1e-3  # keys are fixed, so the statistical tests are deterministic


pytestmark = pytest.mark.usefixtures("one_thread")


def mixed_graph(n: int = 300, seed: int = 0) -> Graph:
    """Coalesced directed graph: degrees 0..~200 (isolated nodes, short rows, hubs)."""
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, 30, (n,), generator=g)
    deg[:5] = 0
    deg[5:10] = torch.tensor([70, 90, 150, 200, 65])
    dst = torch.repeat_interleave(torch.arange(n), deg)
    src = torch.randint(0, n, (dst.numel(),), generator=g)
    feat = torch.randn(n, 6, generator=g, dtype=torch.float64)
    label = torch.randint(0, 3, (n,), generator=g)
    return Graph.from_edges(src, dst, n, ndata={"feat": feat, "label": label}, coalesce=True)


def star_forest(stars: int, leaves: int) -> Graph:
    """``stars`` centres (nodes ``0 .. stars-1``), each with in-edges from its own
    ``leaves`` leaves, listed in order: leaf ``j`` of a centre sits at offset ``j`` of its
    row. Draws of different centres are independent, so one call gives ``stars`` trials."""
    centre = torch.repeat_interleave(torch.arange(stars), leaves)
    leaf = stars + torch.arange(stars * leaves)
    return Graph.from_edges(leaf, centre, stars * (leaves + 1))


def drawn_offsets(g: Graph, block: Block) -> torch.Tensor:
    """Offset inside its row of every sampled edge."""
    return block.edge_ids - g.indptr[block.dst_nodes[block.dst_index()]]


def edge_set(g: Graph) -> set[tuple[int, int]]:
    src, dst = g.edges()
    return set(zip(src.tolist(), dst.tolist(), strict=True))


def check_blocks(g: Graph, batch, fanouts, replace: bool) -> None:
    """Edges exist, counts are min(k, deg) (or k), neighbours are distinct without
    replacement, relabelling is consistent between layers."""
    edges = edge_set(g)
    deg = g.in_degrees()
    blocks = batch.blocks
    assert torch.equal(blocks[-1].dst_nodes, batch.seeds)
    for lower, upper in itertools.pairwise(blocks):
        assert torch.equal(lower.dst_nodes, upper.src_nodes)
    for hop, block in enumerate(reversed(blocks)):
        block.validate()
        k = fanouts[hop]
        assert torch.unique(block.src_nodes).numel() == block.num_src
        src = block.src_nodes[block.indices]
        dst = block.dst_nodes[block.dst_index()]
        assert all(e in edges for e in zip(src.tolist(), dst.tolist(), strict=True))
        assert torch.equal(g.indices[block.edge_ids], src)
        d = deg[block.dst_nodes]
        if k < 0:
            want = d
        elif replace:
            want = torch.where(d > 0, k, 0)
        else:
            want = d.clamp(max=k)
        assert torch.equal(block.in_degrees(), want)
        if not replace:
            for row in range(block.num_dst):
                lo, hi = int(block.indptr[row]), int(block.indptr[row + 1])
                picked = block.edge_ids[lo:hi]
                assert picked.unique().numel() == picked.numel()  # distinct edges
                start = int(g.indptr[block.dst_nodes[row]])
                assert bool(((picked >= start) & (picked < start + int(d[row]))).all())


# ------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize(
    ("fanouts", "replace"),
    [([5, 3], False), ([10, 70, 2], False), ([-1, 4], False), ([6, 3], True)],
)
def test_samples_are_valid(fanouts, replace):
    g = mixed_graph()
    sampler = NeighborSampler(g, fanouts, replace=replace)
    for key, seeds in enumerate([torch.arange(10), torch.tensor([7, 3, 250, 0, 8])]):
        check_blocks(g, sampler.sample(seeds, key=key), fanouts, replace)


def test_fanout_minus_one_takes_every_in_edge():
    g = mixed_graph()
    block = NeighborSampler(g, [-1]).sample(torch.tensor([8, 5, 0, 40])).blocks[0]
    for row, v in enumerate([8, 5, 0, 40]):
        lo, hi = int(block.indptr[row]), int(block.indptr[row + 1])
        got = block.src_nodes[block.indices[lo:hi]]
        assert torch.equal(got, g.indices[g.indptr[v] : g.indptr[v + 1]])


def test_deterministic_and_per_node():
    g = mixed_graph()
    sampler = NeighborSampler(g, [4, 4])
    assert sampler.num_layers == 2
    a = sampler.sample(torch.arange(20), key=7)
    b = sampler.sample(torch.arange(20), key=7)
    for x, y in zip(a.blocks, b.blocks, strict=True):
        assert torch.equal(x.src_nodes, y.src_nodes) and torch.equal(x.indices, y.indices)
    c = sampler.sample(torch.arange(20), key=8)
    assert not torch.equal(a.blocks[-1].edge_ids, c.blocks[-1].edge_ids)
    # a node's draw depends on (key, hop, node) only, not on the rest of the batch
    one = NeighborSampler(g, [4]).sample(torch.tensor([11, 3]), key=7).blocks[0]
    other = NeighborSampler(g, [4]).sample(torch.tensor([3, 250, 11]), key=7).blocks[0]

    def picks(block, v):
        row = int((block.dst_nodes == v).nonzero())
        return block.edge_ids[block.indptr[row] : block.indptr[row + 1]].tolist()

    assert picks(one, 11) == picks(other, 11) and picks(one, 3) == picks(other, 3)
    # and not on the number of threads
    torch.set_num_threads(2)
    d = sampler.sample(torch.arange(20), key=7)
    for x, y in zip(a.blocks, d.blocks, strict=True):
        assert torch.equal(x.src_nodes, y.src_nodes) and torch.equal(x.indices, y.indices)


def test_node_keys_reproduce_a_relabelled_graph():
    g = mixed_graph()
    perm = torch.randperm(g.num_nodes, generator=torch.Generator().manual_seed(1))
    h = g.permute(perm)  # new node i is old node perm[i]
    new_id = torch.empty_like(perm)
    new_id[perm] = torch.arange(perm.numel())
    seeds = torch.tensor([3, 9, 100, 6])
    a = NeighborSampler(g, [5, 3]).sample(seeds, key=4)
    b = NeighborSampler(h, [5, 3], node_keys=perm).sample(new_id[seeds], key=4)
    for x, y in zip(a.blocks, b.blocks, strict=True):
        assert torch.equal(x.src_nodes, perm[y.src_nodes])
        assert torch.equal(x.indptr, y.indptr) and torch.equal(x.indices, y.indices)


@pytest.mark.parametrize(
    ("leaves", "k", "replace"), [(20, 5, False), (100, 7, False), (12, 4, True)]
)
def test_uniform_on_a_star(leaves, k, replace):
    """Chi-square on how often each leaf is drawn (bitmask path: 20 leaves; comparison
    path: 100 leaves; with replacement), over 3000 centres and, for one centre, 300 keys."""
    g = star_forest(3000, leaves)
    sampler = NeighborSampler(g, [k], replace=replace)
    block = sampler.sample(torch.arange(3000), key=5).blocks[0]
    counts = torch.bincount(drawn_offsets(g, block), minlength=leaves)
    assert int(counts.sum()) == 3000 * k
    assert chisquare(counts.numpy()).pvalue > P_MIN
    counts = torch.zeros(leaves, dtype=torch.long)
    for t in range(300):
        block = sampler.sample(torch.tensor([0]), key=derive_key(123, t)).blocks[0]
        counts += torch.bincount(drawn_offsets(g, block), minlength=leaves)
    assert chisquare(counts.numpy()).pvalue > P_MIN


def test_uniform_over_subsets():
    """Every 3-subset of 6 leaves is equally likely (Floyd, not just fair marginals)."""
    g = star_forest(6000, 6)
    block = NeighborSampler(g, [3]).sample(torch.arange(6000), key=2).blocks[0]
    picks = drawn_offsets(g, block).view(6000, 3).sort(1).values
    code = picks[:, 0] * 36 + picks[:, 1] * 6 + picks[:, 2]
    counts = torch.bincount(code, minlength=216)
    subsets = [a * 36 + b * 6 + c for a, b, c in itertools.combinations(range(6), 3)]
    assert int(counts[subsets].sum()) == 6000  # nothing outside the 20 subsets
    assert chisquare(counts[subsets].numpy()).pvalue > P_MIN


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("fanouts", "message"),
    [
        ([], "empty"),
        ("", "empty"),
        ([0], "fan-out 0"),
        ([5, -2], "fan-out 1"),
        ("5,x", "comma-separated"),
        ([2.5], "integer"),
    ],
)
def test_bad_fanouts(fanouts, message):
    with pytest.raises(ValueError, match=message):
        parse_fanouts(fanouts)


def test_bad_input_is_refused():
    g = mixed_graph()
    sampler = NeighborSampler(g, [3])
    with pytest.raises(ValueError, match="distinct"):
        sampler.sample(torch.tensor([1, 2, 1]))
    with pytest.raises(ValueError, match="outside"):
        sampler.sample(torch.tensor([0, g.num_nodes]))
    with pytest.raises(ValueError, match="integer"):
        sampler.sample(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="node_keys"):
        NeighborSampler(g, [3], node_keys=torch.arange(5))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="batch_size"):
            NodeLoader(sampler, torch.arange(10), batch_size=bad)
    with pytest.raises(ValueError, match="prefetch"):
        NodeLoader(sampler, torch.arange(10), batch_size=2, prefetch=-1)
    with pytest.raises(ValueError, match="appears more than once"):
        NodeLoader(sampler, torch.arange(3), 2, keys=torch.tensor([4, 5, 4]))
    with pytest.raises(ValueError, match="among all_keys"):
        NodeLoader(sampler, torch.arange(2), 2, keys=torch.tensor([4, 5]), all_keys=torch.arange(5))
    with pytest.raises(ValueError, match="unknown block model"):
        BlockGNN(4, 8, 2, kind="gin")
    with pytest.raises(ValueError, match="blocks"):
        BlockGNN(6, 8, 3, num_layers=2)(
            [
                Block(
                    torch.arange(3),
                    3,
                    torch.zeros(4, dtype=torch.long),
                    torch.zeros(0, dtype=torch.long),
                )
            ],
            torch.zeros(3, 6),
        )
    with pytest.raises(ValueError, match="batch_size"):
        VertexSampler(g, g.num_nodes + 1, 2)


# ------------------------------------------------------------------------------ blocks
def test_block_validate_names_each_problem():
    def block(src, num_dst, indptr, indices):
        return Block(torch.tensor(src), num_dst, torch.tensor(indptr), torch.tensor(indices))

    block([7, 8, 9], 2, [0, 1, 3], [2, 0, 2]).validate()  # a valid block: no error
    cases = [
        (block([7, 8, 9], 2, [0, 1], [2]), "block indptr has 2 entries, expected num_dst + 1 = 3"),
        (block([7, 8], 3, [0, 0, 0, 0], []), "block has 3 destinations but 2 sources"),
        (block([7, 8, 9], 2, [1, 1, 3], [2, 0]), "block indptr must start at 0 and end at"),
        (block([7, 8, 9], 2, [0, 1, 2], [2, 3]), "block indices must lie in [0, 3)"),
        (block([7, 8, 9], 2, [0, 2, 1], [2]), "block indptr is not non-decreasing"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            bad.validate()


def test_block_formats_pyg_and_dgl():
    g = mixed_graph()
    block = NeighborSampler(g, [6]).sample(torch.tensor([5, 20, 31])).blocks[0]
    ei = block.edge_index
    assert ei.shape == (2, block.num_edges) and block.size == (block.num_src, 3)
    assert torch.equal(block.src_nodes[ei[1]], block.dst_nodes[block.dst_index()])
    dgl = pytest.importorskip("dgl")
    b = block.to_dgl()
    assert b.num_src_nodes() == block.num_src and b.num_dst_nodes() == block.num_dst
    s, d = b.edges()
    assert torch.equal(s, block.indices) and torch.equal(d, block.dst_index())
    assert torch.equal(b.srcdata[dgl.NID], block.src_nodes)
    assert torch.equal(b.edata[dgl.EID], block.edge_ids)


def test_layers_match_pyg():
    """Our block layers give PyG's outputs with the same weights on the same edges."""
    from torch_geometric.nn import GATConv as PygGAT
    from torch_geometric.nn import SAGEConv as PygSAGE

    g = mixed_graph()
    block = NeighborSampler(g, [8, 4]).sample(torch.tensor([5, 20, 31, 6])).blocks[0]
    x = torch.randn(block.num_src, 6, dtype=torch.float64)
    for in_dim, out_dim in ((6, 4), (6, 9)):  # transform before / after aggregating
        ours = SAGEConv(in_dim, out_dim).double()
        ref = PygSAGE(in_dim, out_dim).double()
        with torch.no_grad():
            ref.lin_l.weight.copy_(ours.lin_neigh.weight)
            ref.lin_l.bias.copy_(ours.lin_neigh.bias)
            ref.lin_r.weight.copy_(ours.lin_root.weight)
        want = ref((x, x[: block.num_dst]), block.edge_index, size=block.size)
        torch.testing.assert_close(ours(block, x), want)
    gat = GATConv(6, 8, heads=2).double()
    ref = PygGAT(6, 4, heads=2).double()
    with torch.no_grad():
        ref.lin.weight.copy_(gat.lin.weight)
        ref.att_src.copy_(gat.att_src[None])
        ref.att_dst.copy_(gat.att_dst[None])
        ref.bias.copy_(gat.bias)
    want = ref((x, x[: block.num_dst]), block.edge_index, size=block.size)
    torch.testing.assert_close(gat(block, x), want)


def _dense_reference(model: BlockGNN, g: Graph, x: torch.Tensor) -> torch.Tensor:
    """Full-graph forward with dense matrices (SAGE and GCN)."""
    n = g.num_nodes
    a = torch.zeros(n, n, dtype=x.dtype)
    a[g.rows(), g.indices] = 1.0
    mean = a / a.sum(1, keepdim=True).clamp(min=1)
    loops = a + torch.eye(n, dtype=x.dtype)
    gcn = loops / loops.sum(1, keepdim=True)
    h = x
    for i, layer in enumerate(model.layers):
        if model.kind == "sage":
            h = layer.lin_neigh(mean @ h) + layer.lin_root(h)
        else:
            h = layer.lin(gcn @ h) + layer.bias
        if i < model.num_layers - 1:
            h = torch.relu(h)
    return h


@pytest.mark.parametrize("kind", ["sage", "gcn", "gat"])
def test_layerwise_inference_equals_full_graph(kind):
    g = mixed_graph()
    torch.manual_seed(0)
    model = BlockGNN(6, 8, 3, num_layers=3, dropout=0.5, kind=kind, heads=2).double()
    chunked = layerwise_inference(model, g, batch_size=37)
    assert model.training is True  # restored
    whole = layerwise_inference(model, g, blocks=full_blocks(g))
    torch.testing.assert_close(chunked, whole)
    model.eval()
    if kind != "gat":  # GAT is checked against PyG's layer in test_layers_match_pyg
        torch.testing.assert_close(whole, _dense_reference(model, g, g.feat))
    # and the mini-batch forward with full neighbourhoods gives the same seeds' outputs
    seeds = torch.tensor([8, 0, 140, 5])
    batch = NeighborSampler(g, [-1, -1, -1]).sample(seeds)
    torch.testing.assert_close(model(batch.blocks, g.feat[batch.input_nodes]), whole[seeds])


def test_block_backward_matches_dense():
    g = mixed_graph()
    block = NeighborSampler(g, [5]).sample(torch.arange(40, 60), key=3).blocks[0]
    x = torch.randn(block.num_src, 4, dtype=torch.float64, requires_grad=True)
    layer = SAGEConv(4, 3).double()
    layer(block, x).pow(2).sum().backward()
    a = torch.zeros(block.num_dst, block.num_src, dtype=torch.float64)
    a[block.dst_index(), block.indices] = 1.0
    a = a / a.sum(1, keepdim=True).clamp(min=1)
    xr = x.detach().clone().requires_grad_(True)
    (layer.lin_neigh(a @ xr) + layer.lin_root(xr[: block.num_dst])).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("kind", ["sage", "gcn"])
def test_prepared_operators_give_the_dense_result_and_build_what_backward_needs(kind):
    """``BlockGNN.prepare`` (a loader's ``prepare``) builds each block's aggregation operator
    and, for every block whose sources need a gradient, its transpose (the first block's
    only when it transforms before aggregating: in 9 > out 4); the prepared batch's
    outputs and input gradients equal the dense reference's, also through a first layer
    that transforms first. The operators are the block's: moving it drops them."""
    g = mixed_graph()
    torch.manual_seed(0)
    for dims, first_t in (((6, 8, 3), False), ((9, 4, 3), True)):
        model = BlockGNN(dims[0], dims[1], dims[2], num_layers=2, dropout=0.0, kind=kind)
        model = model.double()
        x = torch.randn(g.num_nodes, dims[0], dtype=torch.float64)
        batch = NeighborSampler(g, [-1, -1]).sample(torch.tensor([8, 0, 140, 5]))
        batch.x = x[batch.input_nodes].clone().requires_grad_(True)
        model.prepare(batch)
        agg = "mean" if kind == "sage" else "sum"
        ops = [b._operators.get((agg, torch.float64)) for b in batch.blocks]
        assert all(op is not None for op in ops)
        assert [op._transposed is not None for op in ops] == [first_t, True]
        out = model(batch.blocks, batch.x)
        out.pow(2).sum().backward()
        assert ops[0] is batch.blocks[0].operator(agg, torch.float64)  # used, not rebuilt
        xr = x.clone().requires_grad_(True)
        model.eval()
        want = _dense_reference(model, g, xr)[batch.seeds]
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        want.pow(2).sum().backward()
        torch.testing.assert_close(batch.x.grad, xr.grad[batch.input_nodes], rtol=1e-12,
                                   atol=1e-12)  # fmt: skip
        assert batch.blocks[1].to("cpu")._operators == {}
    with pytest.raises(ValueError, match="unknown aggregation 'max'"):
        batch.blocks[0].operator("max", torch.float64)


def test_block_layers_honour_edge_weights():
    """Weighted block layers against dense formulas written here: SAGE's weighted mean, GCN's
    weighted sum with a unit self loop, GAT's attention ∝ w·exp(e); unit weights give the
    unweighted layers; BlockGNN looks a graph's weights up through the blocks' edge ids."""
    from gnnpar.models.minibatch.model import GCNConv

    g = mixed_graph()
    gen = torch.Generator().manual_seed(4)
    weights = torch.rand(g.num_edges, generator=gen, dtype=torch.float64) + 0.1
    batch = NeighborSampler(g, [5, 4]).sample(torch.tensor([3, 40, 77, 9]), key=2)
    block = batch.blocks[0]
    w = weights[block.edge_ids]
    x = torch.randn(block.num_src, 6, dtype=torch.float64, generator=gen)
    nd = block.num_dst
    a = torch.zeros(nd, block.num_src, dtype=torch.float64)
    a.index_put_((block.dst_index(), block.indices), w, accumulate=True)
    rowsum = a.sum(1, keepdim=True)
    torch.manual_seed(0)
    for in_dim, out_dim in ((6, 4), (6, 9)):  # transform before / after aggregating
        sage = SAGEConv(in_dim, out_dim).double()
        want = sage.lin_neigh(a / rowsum.clamp(min=1e-300) @ x) + sage.lin_root(x[:nd])
        torch.testing.assert_close(sage(block, x, w), want)
        torch.testing.assert_close(sage(block, x, torch.ones_like(w)), sage(block, x))
        gcn = GCNConv(in_dim, out_dim).double()
        want = gcn.lin((x[:nd] + a @ x) / (1 + rowsum)) + gcn.bias
        torch.testing.assert_close(gcn(block, x, w), want)
        torch.testing.assert_close(gcn(block, x, torch.ones_like(w)), gcn(block, x))
    gat = GATConv(6, 8, heads=2).double()
    z = gat.lin(x).view(-1, 2, 4)
    e = F.leaky_relu(
        (z[:nd] * gat.att_dst).sum(-1)[:, None, :] + (z * gat.att_src).sum(-1)[None, :, :], 0.2
    )  # destinations × sources × heads
    a_loops = a.clone()
    a_loops[torch.arange(nd), torch.arange(nd)] += 1.0  # the self loop weighs 1
    num = a_loops[:, :, None] * torch.exp(e - e.amax(1, keepdim=True))
    att = num / num.sum(1, keepdim=True)
    want = torch.einsum("dsh,shf->dhf", att, z).reshape(nd, 8) + gat.bias
    torch.testing.assert_close(gat(block, x, w), want)
    torch.testing.assert_close(gat(block, x, torch.ones_like(w)), gat(block, x))
    model = BlockGNN(6, 8, 3, num_layers=2, dropout=0.0, kind="gcn").double()
    h = model.forward_layer(0, batch.blocks[0], x, edge_weight=w)
    h = model.forward_layer(1, batch.blocks[1], h, edge_weight=weights[batch.blocks[1].edge_ids])
    torch.testing.assert_close(model(batch.blocks, x, edge_weight=weights), h)


# ------------------------------------------------------------------------------ loader
def _seed_lists(loader) -> list[list[int]]:
    return [b.seeds.tolist() for b in loader]


def test_loader_epochs_batches_and_prefetch():
    g = mixed_graph()
    sampler = NeighborSampler(g, [3, 2])
    seeds = torch.arange(0, 300, 3)
    loader = NodeLoader(sampler, seeds, 16, features=g.feat, labels=g.label, prefetch=2)
    assert len(loader) == 7
    e0 = _seed_lists(loader)
    assert loader.epoch == 1 and sorted(sum(e0, [])) == seeds.tolist()
    assert [len(b) for b in e0] == [16] * 6 + [4]
    e1 = _seed_lists(loader)
    assert e1 != e0 and sorted(sum(e1, [])) == seeds.tolist()
    plain = NodeLoader(sampler, seeds, 16, features=g.feat, labels=g.label, prefetch=0)
    for a, b in zip(
        NodeLoader(sampler, seeds, 16, features=g.feat, prefetch=3), plain, strict=True
    ):
        assert torch.equal(a.seeds, b.seeds) and torch.equal(a.x, b.x)
        assert all(
            torch.equal(x.indices, y.indices) for x, y in zip(a.blocks, b.blocks, strict=True)
        )
    batch = next(iter(NodeLoader(sampler, seeds, 16, features=g.feat, labels=g.label)))
    assert torch.equal(batch.x, g.feat[batch.input_nodes]) and torch.equal(
        batch.y, g.label[batch.seeds]
    )
    on_cpu = NodeLoader(sampler, seeds, 16, features=g.feat, device="cpu", seed=3)
    assert not on_cpu.pin_memory and next(iter(on_cpu)).x.device.type == "cpu"
    dropped = NodeLoader(sampler, seeds, 16, drop_last=True, shuffle=False, prefetch=0)
    assert _seed_lists(dropped) == [seeds[i : i + 16].tolist() for i in range(0, 96, 16)]
    assert batch_sizes(10, 4, False) == [4, 4, 2] and batch_sizes(10, 4, True) == [4, 4]
    # the order of an epoch is a pure function of (seed, epoch, key): the same for any split
    odd, even = seeds[seeds % 2 == 1], seeds[seeds % 2 == 0]
    halves = [NodeLoader(sampler, s, 16, keys=s, all_keys=seeds) for s in (odd, even)]
    whole = NodeLoader(sampler, seeds, 16).epoch_batches(4)
    for i, batch in enumerate(whole):
        got = torch.cat([h.epoch_batches(4)[i] for h in halves])
        assert sorted(got.tolist()) == sorted(batch.tolist())


def test_loader_resumes_mid_epoch():
    g = mixed_graph()
    sampler = NeighborSampler(g, [3, 2])
    full = NodeLoader(sampler, torch.arange(100), 8, seed=5)
    full.set_epoch(3)
    want = [(b.seeds, b.blocks[0].indices) for b in full]
    first = NodeLoader(sampler, torch.arange(100), 8, seed=5)
    first.set_epoch(3)
    for i, _ in enumerate(first):
        if i == 4:
            break
    state = first.state_dict()
    assert state == {"epoch": 3, "position": 5, "seed": 5}
    again = NodeLoader(sampler, torch.arange(100), 8, seed=5)
    again.load_state_dict(state)
    got = [(b.seeds, b.blocks[0].indices) for b in again]
    assert len(got) == len(want) - 5
    for (s1, i1), (s2, i2) in zip(got, want[5:], strict=True):
        assert torch.equal(s1, s2) and torch.equal(i1, i2)
    with pytest.raises(ValueError, match="seed"):
        NodeLoader(sampler, torch.arange(100), 8, seed=6).load_state_dict(state)


def test_prefetch_thread_stops_and_reports_errors():
    g = mixed_graph()
    loader = NodeLoader(NeighborSampler(g, [2]), torch.arange(200), 4, prefetch=2)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    assert not any(t.name == "gnnpar-prefetch" and t.is_alive() for t in threading.enumerate())

    def broken(ids):
        raise RuntimeError("feature store is down")

    bad = NodeLoader(NeighborSampler(g, [2]), torch.arange(20), 4, features=broken)
    with pytest.raises(RuntimeError, match="feature store is down"):
        list(bad)


def test_loader_trains_a_model():
    """A few epochs on an SBM-like graph learn something (a smoke test of the pieces)."""
    from gnnpar.data import sbm

    g = sbm(num_nodes=400, feat_dim=16, feature_noise=1.5, seed=1)
    loader = NodeLoader(
        NeighborSampler(g, [5, 5]), g.train_mask, 16, features=g.feat, labels=g.label
    )
    torch.manual_seed(0)
    model = BlockGNN(16, 16, g.num_classes, 2, dropout=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(15):
        for batch in loader:
            loss = F.cross_entropy(model(batch.blocks, batch.x), batch.y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    pred = layerwise_inference(model, g).argmax(1)
    assert float((pred == g.label)[g.test_mask].float().mean()) > 0.6


# ------------------------------------------------------------------------------ vertex sampling
def test_vertex_sampler_induced_blocks_and_shares():
    g = mixed_graph()
    vs = VertexSampler(g, 60, num_layers=2)
    batch = vs.sample(key=11)
    nodes = batch.seeds
    assert (
        nodes.numel() == 60
        and torch.equal(nodes, vs.nodes(11))
        and torch.equal(nodes, nodes.sort().values)
    )
    block = batch.blocks[0]
    assert batch.blocks[1] is block and torch.equal(block.src_nodes, nodes)
    inside = {
        (u, v) for u, v in edge_set(g) if u in set(nodes.tolist()) and v in set(nodes.tolist())
    }
    got = set(
        zip(
            block.src_nodes[block.indices].tolist(),
            block.dst_nodes[block.dst_index()].tolist(),
            strict=True,
        )
    )
    assert got == inside and block.num_edges == len(inside)
    # shares: destinations first, and together they are the whole block
    rows = []
    for r in range(3):
        share = vs.sample(key=11, share=(r, 3)).blocks[0]
        assert torch.equal(share.src_nodes[: share.num_dst], share.dst_nodes)
        assert torch.equal(share.src_nodes.sort().values, nodes)
        rows += list(
            zip(
                share.src_nodes[share.indices].tolist(),
                share.dst_nodes[share.dst_index()].tolist(),
                strict=True,
            )
        )
    assert sorted(rows) == sorted(got)
    owned = vs.sample(key=11, owned=(100, 200)).blocks[0]
    assert torch.equal(owned.dst_nodes, nodes[(nodes >= 100) & (nodes < 200)])
    # a model runs on the square block
    model = BlockGNN(6, 8, 3).double()
    assert model(batch.blocks, g.feat[batch.input_nodes]).shape == (60, 3)


def test_uniform_subset_is_uniform():
    for n, size in ((50, 5), (50, 30)):  # hashed counters / sorted keys
        counts = torch.zeros(n)
        for t in range(600):
            s = uniform_subset(derive_key(3, t), n, size)
            assert s.unique().numel() == size and int(s.max()) < n
            counts[s] += 1
        assert chisquare(counts.numpy()).pvalue > P_MIN


# ------------------------------------------------------------------ compiled (numba) backend
@pytest.mark.parametrize(
    ("fanouts", "replace"), [([5, 3], False), ([70, 2], False), ([6, 3], True)]
)
def test_numba_backend_equals_the_torch_backend_bit_for_bit(fanouts, replace):
    pytest.importorskip("numba")
    from gnnpar.sampling import Relabeler, sample_rows

    g = mixed_graph()  # isolated nodes, short rows, rows up to 64 and hubs above
    keys = torch.randperm(g.num_nodes, generator=torch.Generator().manual_seed(3))
    for node_keys in (None, keys):
        a, b = (
            NeighborSampler(g, fanouts, replace=replace, node_keys=node_keys, backend=name)
            for name in ("torch", "numba")
        )
        for key, seeds in enumerate([torch.arange(40), torch.tensor([7, 3, 250, 0, 8])]):
            x, y = a.sample(seeds, key=key), b.sample(seeds, key=key)
            for bx, by in zip(x.blocks, y.blocks, strict=True):
                for field in ("src_nodes", "indptr", "indices", "edge_ids"):
                    assert torch.equal(getattr(bx, field), getattr(by, field)), field
    # one key per row (the distributed sampler's owners) and the duplicate-seed error
    rows = torch.tensor([8, 5, 0, 40, 8, 150])
    per_row = torch.tensor([-5, 2**62, 7, 0, 1, -(2**63)])
    want = sample_rows(g.indptr, rows, 4, replace=replace, key=per_row, backend="torch")
    got = sample_rows(g.indptr, rows, 4, replace=replace, key=per_row, backend="numba")
    assert all(torch.equal(u, v) for u, v in zip(want, got, strict=True))
    for name in ("torch", "numba"):
        with pytest.raises(ValueError, match="node 5 appears more than once"):
            Relabeler(g.num_nodes, name).relabel(torch.tensor([4, 5, 5, 9]), 3, True)


_WARM_UP = (
    "import json; from gnnpar.sampling import compiled; "
    "w = compiled.warm_up(['relabel']); again = compiled.warm_up(['relabel']); "
    "print(json.dumps([w.compiled, w.loaded, again.compiled, again.loaded]))"
)


def test_a_warmed_up_kernel_is_compiled_once_then_loaded_from_numbas_cache(tmp_path):
    """The first process compiles (numba's on-disk cache is empty), the next one only loads
    (``cache=True``); a second warm-up in a process does neither."""
    pytest.importorskip("numba")
    import json
    import os
    import subprocess
    import sys

    from gnnpar.sampling import compiled

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", _WARM_UP],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        for _ in range(2)
    ]
    assert runs == [[1, 0, 0, 0], [0, 1, 0, 0]]
    with pytest.raises(ValueError, match="unknown sampling kernel 'spmm'"):
        compiled.warm_up(["relabel", "spmm"])


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown sampling backend 'cuda'"):
        NeighborSampler(mixed_graph(), [2], backend="cuda")
