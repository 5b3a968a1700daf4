"""GAT: the serial model against PyG's ``GATConv`` (same weights, eval mode: logits and every
gradient), its attention dropout drawn from (seed, edge, head) alone.

Float64 throughout; tiny graphs (one process here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gnnpar.nn.dropout import edge_dropout
from gnnpar.nn.gcn import GAT, FullGraphGNN
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


def test_serial_gat_equals_pyg_gatconv_forward_and_gradients():
    gnn = pytest.importorskip("torch_geometric.nn")
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
    ours = model(serial_adj(normalise(a, "gcn")), xr)
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
