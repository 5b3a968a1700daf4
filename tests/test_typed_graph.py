"""Typed graphs (gnnpar.graph.typed): building, checks, storage, relabelling, sampling per
relation (gnnpar.sampling.typed)."""

from __future__ import annotations

import pytest
import torch

from gnnpar.data.storage import load_graph, save_graph
from gnnpar.errors import UserError
from gnnpar.graph.typed import typed_graph
from gnnpar.sampling import NeighborSampler, full_blocks

COUNTS = {"paper": 41, "author": 23, "field": 5}


def _edges(gen: torch.Generator) -> dict:
    def rnd(a: str, b: str, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, COUNTS[a], (m,), generator=gen),
                torch.randint(0, COUNTS[b], (m,), generator=gen))  # fmt: skip

    writes, has = rnd("author", "paper", 97), rnd("paper", "field", 37)
    return {
        ("author", "writes", "paper"): writes,
        ("paper", "rev_writes", "author"): writes[::-1],
        ("paper", "cites", "paper"): rnd("paper", "paper", 113),
        ("paper", "has_topic", "field"): has,
        ("field", "rev_has_topic", "paper"): has[::-1],
    }


@pytest.fixture(scope="module")
def graph():
    gen = torch.Generator().manual_seed(3)
    edges = _edges(gen)
    label = torch.randint(0, 3, (COUNTS["paper"],), generator=gen)
    train = torch.rand(COUNTS["paper"], generator=gen) < 0.5
    return typed_graph(
        COUNTS, edges, features={"paper": torch.randn(41, 6, generator=gen),
                                       "field": torch.randn(5, 2, generator=gen)},
        target="paper", ndata={"label": label, "train_mask": train}, name="tiny",
        num_classes=3,
    )  # fmt: skip


def _typed_edges(g, nodes=None) -> list[tuple[int, int, int]]:
    """(relation, original src, original dst) of every edge, sorted."""
    src, dst = g.edges()
    t = g.types
    return sorted(zip(t.edge_type.tolist(), t.original_ids(src).tolist(),
                      t.original_ids(dst).tolist(), strict=True))  # fmt: skip


def test_the_homogeneous_view_holds_every_typed_edge_and_padded_features(graph):
    t = graph.types
    assert t.node_types == ("paper", "author", "field") and t.offsets == (0, 41, 64, 69)
    assert t.feat_dims == (6, 0, 2) and graph.feat.shape == (69, 6)
    assert t.relation_counts() == [97, 97, 113, 37, 37]
    writes = torch.stack(_edges(torch.Generator().manual_seed(3))[("author", "writes", "paper")])
    got = sorted(e for e in _typed_edges(graph) if e[0] == 0)
    want = sorted((0, s + 41, d) for s, d in writes.t().tolist())
    assert got == want
    assert torch.equal(graph.feat[64:, 2:], torch.zeros(5, 4))  # padding
    assert (graph.label[41:] == -1).all() and not graph.train_mask[41:].any()
    types = t.node_type_of(torch.tensor([0, 40, 41, 63, 64, 68]))
    assert types.tolist() == [0, 0, 1, 1, 2, 2]
    assert t.local_ids_of(torch.tensor([40, 41, 68])).tolist() == [40, 0, 4]


def test_storage_keeps_the_types_and_the_fingerprint(graph, tmp_path):
    back = load_graph(save_graph(graph, tmp_path / "g"))
    assert back.types.meta() == graph.types.meta()
    assert torch.equal(back.types.edge_type, graph.types.edge_type)
    assert back.fingerprint() == graph.fingerprint()
    untyped = load_graph(save_graph(graph.to("cpu"), tmp_path / "h"))
    untyped.types = None
    assert untyped.fingerprint() != graph.fingerprint()


def test_a_relabelled_typed_graph_keeps_every_edge_and_its_relation(graph, tmp_path):
    perm = torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(1))
    p = graph.permute(perm)
    assert torch.equal(p.types.node_ids, perm)
    assert _typed_edges(p) == _typed_edges(graph)
    back = load_graph(save_graph(p, tmp_path / "p"))
    assert _typed_edges(back) == _typed_edges(graph)
    sub = graph.subgraph(torch.arange(0, 69, 2))
    sub.validate()
    assert set(_typed_edges(sub)) <= set(_typed_edges(graph))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda e: e.update({("paper", "bad", "nope"): ([0], [0])}), "known types"),
        (lambda e: e.update({("paper", "cites", "paper"): ([0, 41], [1, 2])}), r"\[0, 41\)"),
        (lambda e: e.update({("paper", "x y", "paper"): ([0], [1])}), "relation name"),
    ],
)
def test_malformed_typed_graphs_are_one_line_errors(change, message):
    edges = _edges(torch.Generator().manual_seed(0))
    change(edges)
    with pytest.raises(UserError, match=message):
        typed_graph(COUNTS, edges)


def test_typed_checks_name_the_field(graph):
    import dataclasses

    bad = graph.to("cpu")
    bad.types = dataclasses.replace(graph.types, edge_type=graph.types.edge_type.flip(0))
    with pytest.raises(UserError, match="of relation .* has a (source|destination) of type"):
        bad.validate()
    with pytest.raises(UserError, match="lose each edge's relation"):
        graph.coalesce()
    g = graph.to("cpu")
    g.ndata = dict(g.ndata, label=torch.zeros(graph.num_nodes, dtype=torch.int64))
    with pytest.raises(UserError, match="'label' is set on nodes outside the target type"):
        g.validate()


# ---------------------------------------------------------------------- sampling per relation
def _per_relation_degrees(graph, nodes):
    """(len(nodes), R) in-degree of every node per relation."""
    src, dst = graph.edges()
    r = graph.types.num_relations
    deg = torch.zeros(graph.num_nodes, r, dtype=torch.int64)
    deg.index_put_((dst, graph.types.edge_type), torch.ones_like(dst), accumulate=True)
    return deg[nodes]


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_each_relation_gets_its_own_fanout(graph, backend):
    sampler = NeighborSampler(graph, "2,cites:1/*:3", backend=backend, seed=5)
    seeds = torch.tensor([0, 7, 40, 50, 66])
    batch = sampler.sample(seeds)
    for block, layer in zip(batch.blocks[::-1], sampler.relation_fanouts, strict=True):
        dst = block.src_nodes[: block.num_dst]
        got = torch.zeros(block.num_dst, 5, dtype=torch.int64)
        got.index_put_((block.dst_index(), block.edge_type), torch.ones(block.num_edges,
                       dtype=torch.int64), accumulate=True)  # fmt: skip
        want = _per_relation_degrees(graph, dst).clamp(max=torch.tensor(layer))
        assert torch.equal(got, want)
        src, _ = graph.edges()
        assert torch.equal(graph.types.edge_type[block.edge_ids], block.edge_type)
        assert torch.equal(src[block.edge_ids], block.src_nodes[block.indices])
        assert torch.equal(block.node_type, graph.types.node_type_of(block.src_nodes))
    other = NeighborSampler(graph, "2,cites:1/*:3", backend="torch", seed=5).sample(seeds)
    assert all(torch.equal(a.edge_ids, b.edge_ids) for a, b in zip(batch.blocks, other.blocks,
                                                                  strict=True))  # fmt: skip


def test_one_fanout_over_all_relations_on_request(graph):
    sampler = NeighborSampler(graph, [2], per_relation=False)
    block = sampler.sample(torch.arange(41)).blocks[0]
    assert int(block.in_degrees().max()) == 2 and block.edge_type is not None


def test_a_relabelled_graph_samples_the_same_typed_edges(graph):
    perm = torch.randperm(graph.num_nodes, generator=torch.Generator().manual_seed(2))
    p = graph.permute(perm)
    new_id = torch.empty_like(perm)
    new_id[perm] = torch.arange(perm.numel())
    seeds = torch.tensor([3, 9, 44])
    a = NeighborSampler(graph, [2, 2], seed=1).sample(seeds)
    b = NeighborSampler(p, [2, 2], seed=1).sample(new_id[seeds])
    for x, y in zip(a.blocks, b.blocks, strict=True):
        assert torch.equal(x.src_nodes, perm[y.src_nodes]) and torch.equal(x.indices, y.indices)
        assert torch.equal(x.edge_type, y.edge_type) and torch.equal(x.node_type, y.node_type)


def test_full_blocks_hold_every_typed_edge_once(graph):
    (block,) = full_blocks(graph)
    assert block.num_edges == graph.num_edges
    assert torch.equal(block.edge_type, graph.types.edge_type)


def test_fanout_mappings_are_checked(graph):
    with pytest.raises(UserError, match="no fan-out for .*rev_writes"):
        NeighborSampler(graph, [{"cites": 2, "writes": 1}])
    with pytest.raises(UserError, match="no relation named 'nope'"):
        NeighborSampler(graph, "nope:2/*:1")
    with pytest.raises(UserError, match="not an integer"):
        NeighborSampler(graph, "cites:x/*:1")


def test_the_loader_prepares_the_typed_indexing_where_it_samples(graph):
    from gnnpar.models.hetero import TypedGNN
    from gnnpar.sampling import NodeLoader

    torch.manual_seed(0)
    model = TypedGNN(graph.types, 8, 3, num_layers=2, kind="rgcn", dropout=0.0).double()
    loader = NodeLoader(
        NeighborSampler(graph, [3, 2]), graph.train_mask, 7, features=graph.feat.double(),
        prefetch=1, device="cpu", prepare=lambda b: [model.typed_block(x) for x in b.blocks],
    )  # fmt: skip
    for batch in loader:
        assert len(batch.prepared) == 2
        with_prepared = model(batch.blocks, batch.x, typed=batch.prepared)
        assert torch.equal(with_prepared, model(batch.blocks, batch.x))
