"""Typed GNNs on blocks (gnnpar.models.hetero): R-GCN and HGT equal PyG's layers with the
same weights (outputs and every gradient, float64), on a whole typed graph as one block and
on a hand-sampled block whose sources reach beyond its destinations; the model's wiring,
its input layer, keyed dropout and checks."""

from __future__ import annotations

import pytest
import torch

from gnnpar.errors import UserError
from gnnpar.graph.typed import typed_graph
from gnnpar.models.hetero import HGTConv, RGCNConv, TypedGNN, TypedInput, TypeGroups
from gnnpar.sampling import NeighborSampler, layerwise_inference
from gnnpar.sampling.block import Block

pyg_conv = pytest.importorskip("torch_geometric.nn.conv")

COUNTS = {"paper": 13, "author": 11, "field": 7}
FEATS = {"paper": 5, "field": 3}  # authors are featureless
TOL = 1e-12


def _graph():
    gen = torch.Generator().manual_seed(7)

    def rnd(a: str, b: str, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, COUNTS[a], (m,), generator=gen),
                torch.randint(0, COUNTS[b], (m,), generator=gen))  # fmt: skip

    writes, has = rnd("author", "paper", 29), rnd("paper", "field", 17)
    edges = {
        ("author", "writes", "paper"): writes,
        ("paper", "rev_writes", "author"): writes[::-1],
        ("paper", "cites", "paper"): rnd("paper", "paper", 23),
        ("paper", "has", "field"): has,
        ("field", "rev_has", "paper"): has[::-1],
        ("author", "likes", "field"): rnd("author", "field", 0),  # no edge at all
    }
    feats = {t: torch.randn(COUNTS[t], d, generator=gen, dtype=torch.float64)
             for t, d in FEATS.items()}  # fmt: skip
    label = torch.randint(0, 3, (COUNTS["paper"],), generator=gen)
    return typed_graph(COUNTS, edges, feats, target="paper", ndata={"label": label},
                       num_classes=3)  # fmt: skip


GRAPH = _graph()
REV_HAS = GRAPH.types.relation_index("rev_has")


def _whole_block(g) -> Block:
    n = g.num_nodes
    nodes = torch.arange(n)
    return Block(src_nodes=nodes, num_dst=n, indptr=g.indptr, indices=g.indices,
                 edge_type=g.types.edge_type, node_type=g.types.node_type_of(nodes))  # fmt: skip


def _sampled_block(g, num_dst: int = 15, seed: int = 3) -> Block:
    """Random destinations (in random order), each with some of its in-edges (none of
    relation rev_has), the sources relabelled: destinations first, then the rest."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.randperm(g.num_nodes, generator=gen)[:num_dst]
    local = {int(v): i for i, v in enumerate(dst)}
    src_nodes, indptr, indices, etypes = dst.tolist(), [0], [], []
    for v in dst.tolist():
        lo, hi = int(g.indptr[v]), int(g.indptr[v + 1])
        for e in range(lo, hi):
            et = int(g.types.edge_type[e])
            if et == REV_HAS or float(torch.rand(1, generator=gen)) < 0.4:
                continue
            u = int(g.indices[e])
            if u not in local:
                local[u] = len(src_nodes)
                src_nodes.append(u)
            indices.append(local[u])
            etypes.append(et)
        indptr.append(len(indices))
    src = torch.tensor(src_nodes)
    return Block(src_nodes=src, num_dst=num_dst, indptr=torch.tensor(indptr),
                 indices=torch.tensor(indices), edge_type=torch.tensor(etypes),
                 node_type=g.types.node_type_of(src))  # fmt: skip


BLOCKS = {"whole": _whole_block(GRAPH), "sampled": _sampled_block(GRAPH)}


def test_the_blocks_are_what_the_comparisons_need():
    b = BLOCKS["sampled"]
    b.validate()
    assert b.num_src > b.num_dst and b.num_dst % 2 == 1
    assert set(b.node_type[: b.num_dst].tolist()) == {0, 1, 2}
    counts = torch.bincount(b.edge_type, minlength=GRAPH.types.num_relations)
    assert counts[REV_HAS] == 0 and counts[-1] == 0 and int((counts > 0).sum()) == 4
    assert not bool((b.node_type[: b.num_dst].diff() >= 0).all())  # types interleaved


def _rel_err(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if want is None:
        return 0.0 if got is None or not bool(got.any()) else float("inf")
    got = torch.zeros_like(want) if got is None else got.detach()
    want = want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-300))


def _grads(out: torch.Tensor, g: torch.Tensor, inputs: list[torch.Tensor]) -> list:
    return list(torch.autograd.grad((out * g).sum(), inputs, allow_unused=True))


@pytest.mark.parametrize("which", ["whole", "sampled"])
@pytest.mark.parametrize(
    ("fi", "fo", "extra"),
    [(7, 5, {}), (5, 7, {}), (7, 5, {"num_bases": 2}), (6, 9, {"num_blocks": 3})],
    ids=["plain-narrowing", "plain-widening", "bases", "blocks"],
)
def test_rgcn_equals_pyg(which, fi, fo, extra):
    block, nd = BLOCKS[which], BLOCKS[which].num_dst
    torch.manual_seed(0)
    rels = GRAPH.types.num_relations
    ref = pyg_conv.RGCNConv(fi, fo, rels, **extra).double()
    with torch.no_grad():
        ref.bias.normal_()
    ours = RGCNConv(fi, fo, rels, **extra).double()
    ours.load_state_dict(ref.state_dict())
    h = torch.randn(block.num_src, fi, dtype=torch.float64, requires_grad=True)
    out = ours(block, h)
    want = ref((h, h[:nd]), block.edge_index, block.edge_type)
    assert out.shape == (nd, fo) and _rel_err(out, want) <= TOL
    g = torch.randn(nd, fo, dtype=torch.float64)
    names = [n for n, _ in ours.named_parameters()]
    got = _grads(out, g, [h, *ours.parameters()])
    exp = _grads(want, g, [h, *(dict(ref.named_parameters())[n] for n in names)])
    for name, a, b in zip(["input", *names], got, exp, strict=True):
        assert b is not None and bool(b.any()), name
        assert _rel_err(a, b) <= TOL, name


def _pyg_hgt_inputs(block: Block, h: torch.Tensor):
    """PyG's x_dict / edge_index_dict of a block (nodes of a type numbered by rank, so a
    type's destinations are its first nodes) and the groups that map them back."""
    types = GRAPH.types
    groups = TypeGroups.build(block.node_type, block.num_dst, types.num_types)
    x = {t: h[groups.sources(i)] for i, t in enumerate(types.node_types)}
    src, dst = groups.rank[block.indices], groups.rank[block.dst_index()]
    edges = {rel: torch.stack([src[block.edge_type == r], dst[block.edge_type == r]])
             for r, rel in enumerate(types.relations)}  # fmt: skip
    return x, edges, groups


def _pyg_hgt(ref, block: Block, h: torch.Tensor) -> torch.Tensor:
    """PyG's HGT on ``block`` as one homogeneous (num_dst, out) tensor."""
    x, edges, groups = _pyg_hgt_inputs(block, h)
    out = ref(x, edges)
    parts = [out[t][: groups.dst_counts[i]] for i, t in enumerate(GRAPH.types.node_types)]
    return groups.merge(parts, dst=True)


def _copy_hgt(ref, ours: HGTConv) -> None:
    """PyG's HGT parameters into ours."""
    types, heads = GRAPH.types, ours.heads
    d = ours.out_dim // heads
    with torch.no_grad():
        for i, t in enumerate(types.node_types):
            ours.kqv[i].load_state_dict(ref.kqv_lin.lins[t].state_dict())
            ours.out_lin[i].load_state_dict(ref.out_lin.lins[t].state_dict())
            ours.skip[i] = ref.skip[t][0]
        for name in ("k_rel", "v_rel"):
            w = getattr(ref, name).weight.view(heads, types.num_relations, d, d).transpose(0, 1)
            getattr(ours, name).copy_(w)
        for r, rel in enumerate(types.relations):
            ours.p_rel[r] = ref.p_rel["__".join(rel)][0]


def _hgt_grads_of_ref(ref, ours: HGTConv, grads: dict) -> list:
    """PyG's gradients in our parameters' layout (None: unused, as zeros)."""
    types, heads = GRAPH.types, ours.heads
    d = ours.out_dim // heads

    def z(p):
        return torch.zeros_like(p) if grads.get(p) is None else grads[p]

    out = {}
    for i, t in enumerate(types.node_types):
        for n, p in ref.kqv_lin.lins[t].named_parameters():
            out[f"kqv.{i}.{n}"] = z(p)
        for n, p in ref.out_lin.lins[t].named_parameters():
            out[f"out_lin.{i}.{n}"] = z(p)
    out["skip"] = torch.cat([z(ref.skip[t]) for t in types.node_types])
    for name in ("k_rel", "v_rel"):
        w = z(getattr(ref, name).weight)
        out[name] = w.view(heads, types.num_relations, d, d).transpose(0, 1)
    out["p_rel"] = torch.cat([z(ref.p_rel["__".join(rel)]) for rel in types.relations])
    return [out[n] for n, _ in ours.named_parameters()]


@pytest.mark.parametrize("which", ["whole", "sampled"])
@pytest.mark.parametrize(("fi", "fo", "heads"), [(9, 9, 3), (7, 6, 2)], ids=["skip", "no-skip"])
def test_hgt_equals_pyg(which, fi, fo, heads):
    block, nd, types = BLOCKS[which], BLOCKS[which].num_dst, GRAPH.types
    torch.manual_seed(1)
    ref = pyg_conv.HGTConv(fi, fo, (list(types.node_types), list(types.relations)), heads)
    ref = ref.double()
    with torch.no_grad():  # not the ones they start at: every parameter matters
        for p in (*ref.p_rel.values(), *ref.skip.values()):
            p.uniform_(-1.5, 1.5)
    ours = HGTConv(fi, fo, types.num_types, types.num_relations, heads).double()
    _copy_hgt(ref, ours)
    h = torch.randn(block.num_src, fi, dtype=torch.float64, requires_grad=True)
    out = ours(block, h)
    want = _pyg_hgt(ref, block, h)
    assert out.shape == (nd, fo) and _rel_err(out, want) <= TOL
    g = torch.randn(nd, fo, dtype=torch.float64)
    got = _grads(out, g, [h, *ours.parameters()])
    ref_params = list(ref.parameters())
    exp = _grads(want, g, [h, *ref_params])
    exp_ours = _hgt_grads_of_ref(ref, ours, dict(zip(ref_params, exp[1:], strict=True)))
    assert _rel_err(got[0], exp[0]) <= TOL
    names = [n for n, _ in ours.named_parameters()]
    for name, a, b in zip(names, got[1:], exp_ours, strict=True):
        assert _rel_err(a, b) <= TOL, name
        if name in ("k_rel", "v_rel", "p_rel"):  # relations without an edge learn nothing
            unused = torch.bincount(block.edge_type, minlength=types.num_relations) == 0
            assert not bool(a[unused].any()) and bool(a[~unused].any())


def test_typed_input_maps_features_and_embeds_featureless_nodes():
    block = BLOCKS["sampled"]
    torch.manual_seed(2)
    enc = TypedInput(GRAPH.types, 4).double()
    x = GRAPH.feat[block.src_nodes].clone().requires_grad_(True)
    out = enc(block, x)
    types, offs = GRAPH.types, GRAPH.types.offsets
    for v, (key, t) in enumerate(zip(block.keys.tolist(), block.node_type.tolist(), strict=True)):
        d, m = types.feat_dims[t], enc.encoders[t]
        want = m(x[v, :d]) if d else m.weight[key - offs[t]]
        assert torch.allclose(out[v], want, rtol=1e-14, atol=0)
    out.square().sum().backward()
    assert not bool(x.grad[:, 3:][block.node_type == 2].any())  # a field's padding
    authors = block.keys[block.node_type == 1] - offs[1]
    touched = enc.encoders[1].weight.grad.abs().sum(1) != 0
    assert torch.equal(torch.nonzero(touched)[:, 0], authors.unique())


def _reference_forward(model: TypedGNN, block: Block, x: torch.Tensor) -> torch.Tensor:
    """The model (eval mode) on one whole-graph block through PyG's layers."""
    types = GRAPH.types
    h = model.input(block, x)
    for layer in model.layers:
        if model.kind == "rgcn":
            ref = pyg_conv.RGCNConv(h.shape[1], layer.out_dim, types.num_relations).double()
            ref.load_state_dict(layer.state_dict())
            h = torch.relu(ref(h, block.edge_index, block.edge_type))
        else:
            meta = (list(types.node_types), list(types.relations))
            ref = pyg_conv.HGTConv(h.shape[1], layer.out_dim, meta, layer.heads).double()
            ref.load_state_dict(_hgt_state_for_pyg(layer, ref))
            h = torch.relu(_pyg_hgt(ref, block, h))
    return model.classifier(h)


def _hgt_state_for_pyg(ours: HGTConv, ref) -> dict:
    """Our HGT parameters in PyG's layout (the inverse of :func:`_copy_hgt`)."""
    types, state = GRAPH.types, {}
    for i, t in enumerate(types.node_types):
        for n, p in ours.kqv[i].state_dict().items():
            state[f"kqv_lin.lins.{t}.{n}"] = p
        for n, p in ours.out_lin[i].state_dict().items():
            state[f"out_lin.lins.{t}.{n}"] = p
        state[f"skip.{t}"] = ours.skip[i : i + 1].detach()
    for name in ("k_rel", "v_rel"):
        w = getattr(ours, name).detach().transpose(0, 1).reshape(-1, *ours.k_rel.shape[2:])
        state[f"{name}.weight"] = w
    for r, rel in enumerate(types.relations):
        state[f"p_rel.{'__'.join(rel)}"] = ours.p_rel[r : r + 1].detach()
    return {k: state[k] for k in ref.state_dict()}


@pytest.mark.parametrize("kind", ["rgcn", "hgt"])
def test_model_equals_pyg_layers_and_layerwise_inference(kind):
    torch.manual_seed(4)
    model = TypedGNN(GRAPH.types, 6, 3, num_layers=2, kind=kind, heads=2, dropout=0.3).double()
    model.eval()
    block = BLOCKS["whole"]
    out = model([block, block], GRAPH.feat)
    assert out.shape == (GRAPH.num_nodes, 3)
    with torch.no_grad():
        want = _reference_forward(model, block, GRAPH.feat)
    assert _rel_err(out, want) <= TOL
    with torch.no_grad():
        assert _rel_err(layerwise_inference(model, GRAPH, blocks=[block]), out) <= TOL
    out.sum().backward()  # every parameter is used
    assert all(p.grad is not None and bool(p.grad.any()) for p in model.parameters())


def test_typed_blocks_with_a_dtype_build_each_relations_operators_and_change_nothing():
    """``typed_block(block, dtype)`` (the loader's prepare) builds every relation's mean
    operator and its transpose; the step on those typed blocks gives the logits and
    gradients of the step on blocks without them, bit for bit, and uses the kept
    operators rather than building its own."""
    torch.manual_seed(6)
    model = TypedGNN(GRAPH.types, 6, 3, num_layers=2, kind="rgcn", dropout=0.0).double()
    batch = NeighborSampler(GRAPH, [3, 3], backend="torch").sample(torch.tensor([11, 2, 7, 4]))
    x = GRAPH.feat[batch.input_nodes]
    grads = []
    for dtype in (None, torch.float64):
        typed = [model.typed_block(b, dtype) for b in batch.blocks]
        kept = [(r, r.operator("mean", torch.float64)) for t in typed for r in t.relations if r]
        if dtype is not None:
            assert kept and all(op._transposed is not None for _, op in kept)
        model.zero_grad()
        out = model(batch.blocks, x, typed=typed)
        out.pow(2).sum().backward()
        assert all(r._operators[("mean", torch.float64)] is op for r, op in kept)
        grads.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1], strict=True))


def test_rgcn_in_type_grouped_rows_equals_the_block_order_layers():
    """``TypedGNN.forward`` runs R-GCN with the rows grouped by type from the input to the
    seeds (one regrouping at the end); with keyed dropout on, its logits and every gradient
    equal those of the layers run in block order (``forward_layer(..., grouped=False)``)
    within 1e-12, on a sample whose seeds are of every type."""
    torch.manual_seed(8)
    model = TypedGNN(GRAPH.types, 6, 3, num_layers=2, kind="rgcn", dropout=0.3).double()
    seeds = torch.tensor([11, 2, 30, 7, 25, 19])
    batch = NeighborSampler(GRAPH, [3, 3], backend="torch").sample(seeds)
    assert len(set(model.schema.node_type_of(seeds).tolist())) == 3
    x = GRAPH.feat[batch.input_nodes]
    results = []
    for grouped in (True, False):
        model.zero_grad()
        if grouped:
            out = model(batch.blocks, x, dropout_seed=4)
        else:
            out = x
            for i, block in enumerate(batch.blocks):
                out = model.forward_layer(i, block, out, dropout_seed=4)
        out.pow(2).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = results
    assert _rel_err(a, b) <= TOL
    assert all(_rel_err(u, v) <= TOL for u, v in zip(ga, gb, strict=True))


@pytest.mark.parametrize("kind", ["rgcn", "hgt"])
def test_keyed_dropout_makes_a_full_neighbour_sample_equal_the_whole_graph(kind):
    torch.manual_seed(5)
    model = TypedGNN(GRAPH.types, 6, 3, kind=kind, heads=3, dropout=0.4).double()
    seeds = torch.tensor([11, 2, 7])
    batch = NeighborSampler(GRAPH, [-1, -1], backend="torch").sample(seeds)
    whole = BLOCKS["whole"]
    sampled = model(batch.blocks, GRAPH.feat[batch.input_nodes], dropout_seed=9)
    full = model([whole, whole], GRAPH.feat, dropout_seed=9)
    assert _rel_err(sampled, full[seeds]) <= TOL
    other = model(batch.blocks, GRAPH.feat[batch.input_nodes], dropout_seed=10)
    assert not torch.allclose(sampled, other)
    model.eval()
    assert not torch.allclose(model(batch.blocks, GRAPH.feat[batch.input_nodes]), sampled)


def test_mistakes_are_one_line_user_errors():
    block = BLOCKS["sampled"]
    h = torch.randn(block.num_src, 4, dtype=torch.float64)
    rels = GRAPH.types.num_relations
    with pytest.raises(UserError, match="not both"):
        RGCNConv(4, 4, rels, num_bases=2, num_blocks=2)
    with pytest.raises(UserError, match="must divide"):
        RGCNConv(4, 6, rels, num_blocks=4)
    with pytest.raises(UserError, match="heads"):
        HGTConv(4, 5, 3, rels, heads=2)
    untyped = Block(block.src_nodes, block.num_dst, block.indptr, block.indices)
    with pytest.raises(UserError, match="typed block"):
        RGCNConv(4, 4, rels).double()(untyped, h)
    swapped = Block(block.src_nodes, block.num_dst, block.indptr, block.indices,
                    edge_type=(block.edge_type + 1) % rels, node_type=block.node_type)  # fmt: skip
    with pytest.raises(UserError, match="relation"):
        TypedGNN(GRAPH.types, 4, 3, num_layers=1)([swapped], GRAPH.feat[block.src_nodes])
    relabelled = Block(block.src_nodes.flip(0), block.num_dst, block.indptr, block.indices,
                       edge_type=block.edge_type, node_type=block.node_type)  # fmt: skip
    with pytest.raises(UserError, match="original ids"):
        TypedInput(GRAPH.types, 4)(relabelled, GRAPH.feat[block.src_nodes])
    with pytest.raises(UserError, match="2 layers but got 1"):
        TypedGNN(GRAPH.types, 4, 3)([block], GRAPH.feat[block.src_nodes])
    with pytest.raises(UserError, match="unknown typed model"):
        TypedGNN(GRAPH.types, 4, 3, kind="gat")
