"""Small graphs and serial references shared by the full-graph tests."""

from __future__ import annotations

import torch

from gnnpar.models.fullgraph.model import FullGraphGNN
from gnnpar.sparse.csr import CSRBlock, from_coo
from gnnpar.sparse.kernels import LocalSpMM
from gnnpar.sparse.source import MemorySource, make_permutations


def small_graph(n: int = 23, feat: int = 7, classes: int = 3, seed: int = 0, weighted=False):
    """A random undirected graph with features, labels and a train mask (float64); with
    ``weighted`` its edges weigh 0.25 to 4, the two directions of an edge differently."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (4 * n,), generator=g)
    dst = torch.randint(0, n, (4 * n,), generator=g)
    a = torch.zeros(n, n, dtype=torch.float64)
    a[src, dst] = 1.0
    a[dst, src] = 1.0
    a.fill_diagonal_(0.0)
    if weighted:
        a = a * torch.exp2(torch.rand(n, n, generator=g, dtype=torch.float64) * 4 - 2)
    x = torch.randn(n, feat, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    train = torch.rand(n, generator=g) < 0.6
    return a, x, y, train


def normalise(a: torch.Tensor, kind: str) -> torch.Tensor:
    """Dense Â = D^-1/2 (A+I) D^-1/2 (gcn), A + I (gat and gin: the raw weights, written out
    here for a graph without self loops) or row-normalised A (sage)."""
    if kind in ("gat", "gin", "raw"):
        return a + torch.eye(a.shape[0], dtype=a.dtype)
    if kind == "gcn":
        a = a + torch.eye(a.shape[0], dtype=a.dtype)
        d = a.sum(1).pow(-0.5)
        return d[:, None] * a * d[None, :]
    deg = a.sum(1)
    return a / torch.where(deg > 0, deg, 1.0)[:, None]  # a weighted row may sum below 1


def dense_to_block(a: torch.Tensor) -> CSRBlock:
    """CSR block of a dense matrix."""
    r, c = a.nonzero(as_tuple=True)
    return from_coo(r, c, a[r, c], tuple(a.shape))


def make_source(
    a_hat: torch.Tensor, x, y, train, permute: bool, seed: int = 3, norm: str | None = None
) -> MemorySource:
    """A memory source over the dense normalised adjacency (``norm``: which one it is)."""
    blk = dense_to_block(a_hat)
    perms = make_permutations("random" if permute else "none", blk.indptr, blk.indices, seed)
    return MemorySource(
        blk.indptr, blk.indices, blk.values, x, {"label": y, "train_mask": train}, perms,
        norm=norm,
    )  # fmt: skip


def serial_model(kind: str, dims: list[int], dropout: float = 0.0, seed: int = 0):
    """A float64 plain model with non-trivial biases."""
    torch.manual_seed(seed)
    m = FullGraphGNN(dims[0], dims[1], dims[-1], len(dims) - 1, dropout, kind=kind).double()
    with torch.no_grad():
        for layer in m.layers:
            layer.bias.normal_()
    return m


def serial_adj(a_hat: torch.Tensor) -> LocalSpMM:
    """The whole normalised adjacency as a local SpMM."""
    return LocalSpMM(dense_to_block(a_hat))


def check_schedule(fwd, bwd, schedule: dict, tag: str) -> None:
    """Measured bytes per axis (``comm.record`` traffic of one forward and one backward) equal
    the layer's own schedule (``expected_bytes()``), each collective rounding once."""
    for rec, part in ((fwd, "forward"), (bwd, "backward")):
        got = rec.by_axis()
        for axis in set(got) | set(schedule[part]):
            want = schedule[part].get(axis, 0.0)
            if abs(got.get(axis, 0) - want) > max(1, rec.calls(axis=axis)):
                raise AssertionError(f"{part} bytes on {axis}: {got} vs schedule {want} ({tag})")


def small_typed_graph(seed: int = 0):
    """A float64 typed graph of 23 nodes (odd everywhere): papers (11, 5 features, the
    target: 3 classes, a train mask), authors (7, 3 features) and fields (5, featureless);
    five relations, one of them (``field___tags___paper``) a single edge, and one duplicate
    edge (``writes``), which the mean counts twice, as PyG does."""
    from gnnpar.graph.typed import typed_graph

    g = torch.Generator().manual_seed(seed)

    def pairs(n_src: int, n_dst: int, m: int):
        src = torch.randint(0, n_src, (m,), generator=g)
        return src, torch.randint(0, n_dst, (m,), generator=g)

    writes = pairs(7, 11, 14)
    writes = (torch.cat([writes[0], writes[0][:1]]), torch.cat([writes[1], writes[1][:1]]))
    edges = {
        ("author", "writes", "paper"): writes,
        ("paper", "cites", "paper"): pairs(11, 11, 19),
        ("paper", "rev_writes", "author"): (writes[1], writes[0]),
        ("field", "tags", "paper"): (torch.tensor([3]), torch.tensor([5])),
        ("paper", "has_topic", "field"): pairs(11, 5, 9),
    }
    features = {
        "paper": torch.randn(11, 5, generator=g, dtype=torch.float64),
        "author": torch.randn(7, 3, generator=g, dtype=torch.float64),
    }
    ndata = {
        "label": torch.randint(0, 3, (11,), generator=g),
        "train_mask": torch.rand(11, generator=g) < 0.7,
    }
    return typed_graph(
        {"paper": 11, "author": 7, "field": 5}, edges, features, "paper", ndata,
        name="typed23", num_classes=3,
    )  # fmt: skip


def learnt_input(feat: torch.Tensor, types, seed: int) -> torch.Tensor:
    """``feat`` with the featureless types' rows the learnt table's initial rows (seed
    ``seed``): the input a serial model sees where a parallel one learns those rows."""
    from gnnpar.models.fullgraph.embedding import featureless_mask, initial_rows

    x = feat.clone()
    ids = torch.nonzero(featureless_mask(types, torch.arange(x.shape[0])))[:, 0]
    x[ids] = initial_rows(ids, (0, x.shape[1]), seed, x.dtype)
    return x


def serial_rgcn(
    dims: list[int],
    relations: int,
    dropout: float = 0.0,
    seed: int = 0,
    num_bases: int | None = None,
):
    """A float64 plain R-GCN with non-trivial biases (``num_bases``: with bases)."""
    torch.manual_seed(seed)
    m = FullGraphGNN(
        dims[0], dims[1], dims[-1], len(dims) - 1, dropout, kind="rgcn",
        num_relations=relations, num_bases=num_bases,
    ).double()  # fmt: skip
    with torch.no_grad():
        for layer in m.layers:
            layer.bias.normal_()
    return m
