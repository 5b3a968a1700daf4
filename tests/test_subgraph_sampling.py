"""GraphSAINT and ClusterGCN subgraph samplers (gnnpar.sampling.saint, .cluster) and the
sage task's ``--sampler`` choices.

- every sampler is a function of (seed, epoch, index): the same batches twice, prefetched or
  not, and a loader resumed from its state continues with the same batches;
- a ClusterGCN batch holds exactly the graph's edges between its chosen clusters, and an
  epoch visits every cluster once;
- GraphSAINT's normalisation is unbiased (Zeng et al. 2020, propositions 1 and 2): over many
  subgraphs, the mean of a node's normalised aggregation (one linear mean-aggregation layer)
  is its full-graph aggregation, and the mean of the λ-weighted loss is the full mean
  training loss, within confidence bounds computed here from the samples (and from the
  pre-sampling counts the weights are estimated from);
- a 2-rank ``gnnpar train sage --sampler saint-rw`` run resumed from a checkpoint ends where
  an uninterrupted run does.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gnnpar import checkpoint
from gnnpar.cli import main
from gnnpar.models.minibatch.task import MiniBatchConfig
from gnnpar.sampling import (
    ClusterSampler,
    SaintEdgeSampler,
    SaintNodeSampler,
    SaintWalkSampler,
    SubgraphLoader,
    induced_block,
)
from gnnpar.train.config import ConfigError
from tests.cli_world import run_commands

Z = 5.0  # standard errors of the confidence bounds (over ~100 checks: no false alarms)


def _graph(n: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A small undirected graph with uneven degrees (a ring plus random chords to hubs)."""
    gen = torch.Generator().manual_seed(seed)
    src = list(range(n))
    dst = [(i + 1) % n for i in range(n)]
    for i in range(n):
        for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):
            src.append(i)
            dst.append(int(torch.randint(0, 4, (1,), generator=gen)))  # hubs 0..3
    pairs = {(a, b) for a, b in zip(src, dst, strict=True) if a != b}
    pairs |= {(b, a) for a, b in pairs}
    edges = torch.tensor(sorted(pairs, key=lambda e: (e[1], e[0])))
    rows, cols = edges[:, 1], edges[:, 0]
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(rows, minlength=n), 0, out=indptr[1:])
    return indptr, cols


def _samplers(graph, presample: int = 20, seed: int = 3):
    train = torch.arange(graph[0].numel() - 1) % 3 != 0
    kw = {"presample": presample, "seed": seed, "train_mask": train}
    return {
        "node": SaintNodeSampler(graph, 2, budget=8, **kw),
        "edge": SaintEdgeSampler(graph, 2, budget=4, **kw),
        "rw": SaintWalkSampler(graph, 2, budget=3, walk_length=2, **kw),
        "cluster": ClusterSampler(graph, 2, 6, 2, seed=seed, train_mask=train),
    }


def _signature(batch) -> list[torch.Tensor]:
    block = batch.blocks[0]
    parts = [batch.seeds, block.indptr, block.indices, batch.seed_weight]
    return parts + ([block.edge_weight] if block.edge_weight is not None else [])


def _same_batches(a, b) -> bool:
    return all(
        len(sa := _signature(x)) == len(sb := _signature(y))
        and all(torch.equal(p, q) for p, q in zip(sa, sb, strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("kind", ["node", "edge", "rw", "cluster"])
def test_samplers_are_reproducible_and_resume_exactly(kind, one_thread):
    graph = _graph()
    first, again = _samplers(graph)[kind], _samplers(graph)[kind]
    batches = [first.batch(e, i) for e in range(2) for i in range(3)]
    assert _same_batches(batches, [again.batch(e, i) for e in range(2) for i in range(3)])
    distinct = {tuple(b.seeds.tolist()) for b in batches}
    assert len(distinct) > 1, "every subgraph is the same"
    assert any(not torch.equal(batches[i].seeds, batches[3 + i].seeds) for i in range(3)), (
        "epoch 1 repeats epoch 0"
    )
    for b in batches:
        b.blocks[0].validate()
        assert bool((b.seeds[1:] > b.seeds[:-1]).all())
    # the loader: prefetched or not, and resumed from its state mid-epoch, on rank 1 of 2
    feat = torch.arange(graph[0].numel() - 1, dtype=torch.float64)[:, None]

    def loader(prefetch: int) -> SubgraphLoader:
        return SubgraphLoader(first, features=feat, rank=1, ranks=2, batches=6, prefetch=prefetch)

    once = loader(0)
    plain = [b for _ in range(2) for b in once]
    straight = loader(1)
    ahead = [b for _ in range(2) for b in straight]
    assert _same_batches(plain, ahead) and len(plain) == 2 * len(straight) == 6
    assert [b.index for b in plain[:3]] == [1, 3, 5]  # rank 1 of 2 takes every other one
    stopped = loader(1)
    it = iter(stopped)
    head = [next(it)]
    state = stopped.state_dict()
    it.close()
    resumed = loader(0)
    resumed.load_state_dict(state)
    tail = list(resumed) + list(resumed)
    assert _same_batches(head + tail, plain)
    assert torch.equal(plain[0].x[:, 0].long(), plain[0].seeds)


def test_cluster_batches_hold_exactly_the_edges_between_their_clusters():
    indptr, indices = _graph(n=40, seed=1)
    sampler = ClusterSampler((indptr, indices), 2, num_clusters=8, clusters_per_batch=3)
    owner = sampler.owner
    rows = torch.repeat_interleave(torch.arange(40), indptr[1:] - indptr[:-1])
    seen, between = [], 0
    for index in range(sampler.batches_per_epoch):
        chosen = sampler.clusters(0, index)
        seen += chosen.tolist()
        batch = sampler.batch(0, index)
        block = batch.blocks[0]
        got = set(
            zip(
                block.src_nodes[block.indices].tolist(),
                block.dst_nodes[block.dst_index()].tolist(),
                strict=True,
            )
        )
        inside = torch.isin(owner, chosen)
        keep = inside[rows] & inside[indices]
        want = set(zip(indices[keep].tolist(), rows[keep].tolist(), strict=True))
        assert got == want
        assert torch.equal(batch.seeds, torch.nonzero(inside, as_tuple=True)[0])
        between += sum(1 for u, v in want if owner[u] != owner[v])
    assert sorted(seen) == list(range(8))  # one epoch visits every cluster once
    assert between > 0  # edges between the chosen clusters were restored


def test_induced_block_compiled_equals_tensor_path():
    """The numba loop (whole node sets) builds the block the tensor path builds."""
    pytest.importorskip("numba")
    indptr, indices = _graph(n=40, seed=2)
    gen = torch.Generator().manual_seed(4)
    for b in (0, 1, 9, 40):
        nodes = torch.sort(torch.randperm(40, generator=gen)[:b]).values
        fast = induced_block(indptr, indices, nodes)
        slow = induced_block(indptr, indices, nodes, col_ids=torch.arange(40))  # tensor path
        assert torch.equal(fast.indptr, slow.indptr) and torch.equal(fast.indices, slow.indices)
        assert torch.equal(fast.src_nodes, nodes)
        assert torch.equal(indices[fast.edge_ids], nodes[fast.indices])


def _full_mean(indptr, indices, x):
    deg = (indptr[1:] - indptr[:-1]).clamp(min=1).to(x.dtype)
    rows = torch.repeat_interleave(torch.arange(indptr.numel() - 1), indptr[1:] - indptr[:-1])
    out = torch.zeros_like(x).index_add_(0, rows, x[indices])
    return out / deg[:, None]


@pytest.mark.parametrize("kind", ["node", "edge", "rw"])
def test_saint_normalisation_is_unbiased(kind, one_thread):
    """Mean over subgraphs of (a) every node's normalised aggregation, given that it is in
    the subgraph, and (b) the λ-weighted loss sum, against the full-graph values."""
    indptr, indices = _graph()
    n = indptr.numel() - 1
    sampler = _samplers((indptr, indices), presample=2000)[kind]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    losses = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5
    full = _full_mean(indptr, indices, x)
    train = sampler.train_mask
    full_loss = float(losses[train].mean())
    draws = 1500
    agg_sum = torch.zeros(n, 2, dtype=torch.float64)
    agg_sq = torch.zeros(n, 2, dtype=torch.float64)
    hits = torch.zeros(n, dtype=torch.float64)
    loss_draws = torch.zeros(draws, dtype=torch.float64)
    for i in range(draws):
        batch = sampler.batch(1, i)
        block, nodes = batch.blocks[0], batch.seeds
        rows = block.dst_index()
        z = torch.zeros(nodes.numel(), 2, dtype=torch.float64)
        z.index_add_(0, rows, block.edge_weight[:, None] * x[nodes[block.indices]])
        agg_sum[nodes] += z
        agg_sq[nodes] += z * z
        hits[nodes] += 1
        loss_draws[i] = float((batch.seed_weight * losses[nodes]).sum())
    # (a) aggregation: sampling error of each node's conditional mean, plus the error of the
    # weights estimated from the pre-sampling counts (delta method: relative variance of
    # C_v / C_uv is about 1 / C_uv - 1 / C_v)
    seen = hits >= 30
    assert int(seen.sum()) >= n // 2
    mean = agg_sum[seen] / hits[seen, None]
    var = (agg_sq[seen] / hits[seen, None] - mean**2).clamp(min=0) / hits[seen, None]
    rows = torch.repeat_interleave(torch.arange(n), indptr[1:] - indptr[:-1])
    deg = (indptr[1:] - indptr[:-1]).to(torch.float64)
    c_v, c_e = sampler.node_count[rows].clamp(min=1), sampler.edge_count.clamp(min=1)
    rel = (1.0 / c_e - 1.0 / c_v).clamp(min=0)
    term = (x[indices] / deg[rows, None]) ** 2 * rel[:, None]
    est = torch.zeros(n, 2, dtype=torch.float64).index_add_(0, rows, term)[seen]
    bound = Z * torch.sqrt(var + est) + 1e-12
    worst = float(((mean - full[seen]).abs() / bound).max())
    assert worst <= 1.0, f"{kind}: aggregation off by {worst:.2f} of its {Z}-sigma bound"
    # (b) the loss: the mean of the λ-weighted sums is the mean training loss
    p_hat = sampler.node_count.clamp(min=1) / sampler.presample
    n_train = int(train.sum())
    est_var = float(
        ((losses / n_train) ** 2 * (1 - p_hat) / sampler.node_count.clamp(min=1))[train].sum()
    )
    se = math.sqrt(float(loss_draws.var()) / draws + est_var)
    gap = abs(float(loss_draws.mean()) - full_loss)
    assert gap <= Z * se, f"{kind}: loss mean off by {gap:.4g} (bound {Z * se:.4g})"


def _saint_argv(out: Path, epochs: int, *extra: str) -> list[str]:
    return ["train", "sage", "--sampler", "saint-rw", "--budget", "12", "--walk-length", "2",
            "--presample", "5", "--dataset", "sbm", "--dataset-options",
            "num_nodes=120,feat_dim=6", "--root", str(out.parent / "data"), "--dtype",
            "float64", "--epochs", str(epochs), "--hidden", "8", "--nprocs", "2", "--out",
            str(out), "--eval-every", "0", "--quiet", "--prefetch", "1",
            *extra]  # fmt: skip


def test_two_rank_saint_run_resumes_exactly(tmp_path):
    saved, resumed, straight = tmp_path / "saved", tmp_path / "resumed", tmp_path / "straight"
    codes = run_commands(2, [
        _saint_argv(saved, 2),
        ("copy", saved, resumed),
        _saint_argv(resumed, 4, "--resume"),
        _saint_argv(straight, 4),
    ])  # fmt: skip
    assert codes == [[0, 0, 0]] * 2
    a, b = checkpoint.consolidate(resumed), checkpoint.consolidate(straight)
    assert list(a) == list(b)
    for k, v in b.items():
        assert torch.equal(a[k], v), k
    s = checkpoint.consolidate(saved)
    assert any(not torch.equal(s[k], v) for k, v in b.items())  # it did train on
    # one process taking both subgraphs of every step (--subgraphs-per-step 2, accumulated)
    # trains as the 2 ranks do: the same subgraphs, dropout masks and averaged gradients
    one = tmp_path / "one"
    argv = _saint_argv(one, 4, "--subgraphs-per-step", "2")
    i = argv.index("--nprocs")
    assert main(argv[:i] + argv[i + 2 :]) == 0
    c = checkpoint.consolidate(one)
    for k, v in b.items():
        assert float((c[k] - v).abs().max()) <= 1e-12 * max(float(v.abs().max()), 1.0), k


def test_subgraph_loader_steps_take_the_same_subgraphs_on_any_number_of_ranks():
    sampler = SaintWalkSampler(_graph(), 2, budget=3, presample=2)
    steps = {}
    for ranks in (1, 2, 4):
        for rank in range(ranks):
            loader = SubgraphLoader(sampler, rank=rank, ranks=ranks, batches=9, per_step=4)
            batches = list(loader)
            assert len(loader) == len(batches) == 3 * 4 // ranks  # ceil(9 / 4) steps
            assert [b.micro for b in batches] == list(range(4 // ranks)) * 3
            for i, b in enumerate(batches):
                steps.setdefault(ranks, {}).setdefault(i * ranks // 4, []).append(b.index)
    for ranks in (1, 2, 4):
        assert {k: sorted(v) for k, v in steps[ranks].items()} == {
            s: list(range(4 * s, 4 * s + 4)) for s in range(3)
        }
    with pytest.raises(ValueError, match="multiple of the 2 ranks"):
        SubgraphLoader(sampler, rank=0, ranks=2, per_step=3)
    with pytest.raises(ConfigError, match="'subgraphs_per_step' is for the saint"):
        MiniBatchConfig(subgraphs_per_step=4).check()
    with pytest.raises(ConfigError, match="'subgraphs_per_step' must be >= 0"):
        MiniBatchConfig(sampler="saint-rw", subgraphs_per_step=-1).check()


def test_weighted_graphs_saint_mean_and_cluster_blocks_carry_the_weights():
    """A weighted graph: GraphSAINT's aggregation is ``Â_vu / α_uv`` with Â the weighted mean
    ``w_vu / Σ_u w_vu`` (written out here from the pre-sampling counts), and a ClusterGCN
    block records its edges' weights."""
    from gnnpar.graph import Graph

    indptr, indices = _graph(n=30, seed=2)
    rows = torch.repeat_interleave(torch.arange(30), indptr[1:] - indptr[:-1])
    w = torch.rand(indices.numel(), generator=torch.Generator().manual_seed(4)) * 2 + 0.1
    graph = Graph(indptr, indices, edge_weight=w)
    saint = SaintNodeSampler(graph, 2, budget=8, presample=10, seed=1)
    total = torch.zeros(30, dtype=torch.float64).index_add(0, rows, w.double())
    c_v = saint.node_count.clamp(min=1.0)
    want = w.double() / total[rows] / (saint.edge_count.clamp(min=1.0) / c_v[rows])
    torch.testing.assert_close(saint.edge_weight, want, rtol=1e-12, atol=0)
    block = saint.sample(5).blocks[0]
    assert block.weight is None  # the normalisation already holds the weights
    assert torch.equal(block.edge_weight, saint.edge_weight[block.edge_ids])
    batch = ClusterSampler(graph, 2, 6, 2, seed=1).batch(0, 0)
    block = batch.blocks[0]
    assert torch.equal(block.weight, w.double()[block.edge_ids])


@pytest.mark.parametrize("probability", ["norm", "degree"])
def test_node_sampler_draws_by_its_probability(probability, one_thread):
    """Every node's share of the pre-sampling subgraphs is its inclusion probability
    1 - (1 - P(u))^budget, with P(u) written out here: ``norm`` sums 1 / deg(v)² over the
    nodes v that aggregate u (the paper's ||Â_{:,u}||²), ``degree`` is deg(u) (the
    authors' code); the two differ on this graph's hubs and their neighbours."""
    indptr, indices = _graph()
    n, budget, rounds = indptr.numel() - 1, 8, 3000
    sampler = SaintNodeSampler((indptr, indices), 2, budget, probability, presample=rounds, seed=5)
    weight = torch.zeros(n, dtype=torch.float64)
    for v in range(n):
        for u in indices[indptr[v] : indptr[v + 1]].tolist():
            weight[u] += (
                1.0 / float(indptr[v + 1] - indptr[v]) ** 2 if probability == "norm" else 1.0
            )
    p = weight / weight.sum()
    inclusion = 1 - (1 - p) ** budget
    share = sampler.node_count / rounds
    se = torch.sqrt(inclusion * (1 - inclusion) / rounds)
    worst = float(((share - inclusion).abs() / (Z * se)).max())
    assert worst <= 1.0, f"{probability}: a node's share is off by {worst:.2f} of its bound"
    with pytest.raises(ValueError, match="probability must be one of"):
        SaintNodeSampler((indptr, indices), 2, budget, "uniform")
    with pytest.raises(ConfigError, match="'node_probability' must be one of"):
        MiniBatchConfig(sampler="saint-node", node_probability="uniform").check()
