"""Distributed sampling, feature fetching, inference and a training step over 2 and 4 parts,
each against a single-process reference on the whole graph.

One world per size runs every check (starting a world costs seconds); the 2-part world's
graph is weighted (the sampled edges' weights travel with them, and the weighted mean of
inference and training equals one process's). The partition folder is written by the test
process; ranks return numpy arrays (tensors would need the sender
alive to be unpickled).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import partitioners
from gnnpar.data import sbm
from gnnpar.models.minibatch.model import BlockGNN
from gnnpar.sampling import (
    LocalPart,
    NeighborSampler,
    NodeLoader,
    VertexSampler,
    layerwise_inference,
)
from gnnpar.testing import run_distributed

SAMPLERS = {"plain": ([4, 3], False), "all": ([-1, 2], False), "replace": ([3, 3], True)}
KEY = 1234
CACHE = 25
VERTICES = 40


def graph(weighted: bool = False):
    g = sbm(num_nodes=300, feat_dim=5, num_classes=3, avg_degree=8.0, seed=2)
    if weighted:  # 0.25 to 4, the two directions of an edge apart
        gen = torch.Generator().manual_seed(5)
        g.edge_weight = torch.exp2(torch.rand(g.num_edges, generator=gen) * 4 - 2)
    return g


def model_state():
    torch.manual_seed(0)
    model = BlockGNN(5, 8, 3, num_layers=2, dropout=0.0)
    return {k: v.clone() for k, v in model.state_dict().items()}


def seed_sets(num_parts: int, n: int) -> list[torch.Tensor]:
    """Original ids per rank; the last rank of a 4-rank world gets none."""
    g = torch.Generator().manual_seed(num_parts)
    sets = [torch.randperm(n, generator=g)[: 12 + 3 * r] for r in range(num_parts)]
    if num_parts == 4:
        sets[3] = sets[3][:0]
    return sets


def _np(blocks) -> list[tuple]:
    return [(b.src_nodes.numpy(), b.num_dst, b.indptr.numpy(), b.indices.numpy()) for b in blocks]


def _rank_checks(folder: str, seeds_new: list[torch.Tensor], state: dict) -> dict:
    import gnnpar
    from gnnpar import comm
    from gnnpar.sampling import DistNeighborSampler, FeatureFetcher, distributed_inference
    from gnnpar.shard import shard

    grid = gnnpar.init()
    sample_grid = gnnpar.init()  # fresh groups, as a prefetching loader uses
    r = grid.rank("data")
    part = LocalPart.load(folder, r)
    out: dict = {}
    for name, (fanouts, replace) in SAMPLERS.items():
        sampler = DistNeighborSampler(part, fanouts, sample_grid, replace=replace)
        batch = sampler.sample(seeds_new[r], key=KEY + r)
        out[name] = _np(batch.blocks)
        out[f"{name} weights"] = [None if b.weight is None else b.weight.numpy()
                                  for b in batch.blocks]  # fmt: skip
    plain = DistNeighborSampler(part, SAMPLERS["plain"][0], sample_grid).sample(
        seeds_new[r], key=KEY + r
    )
    ids = plain.input_nodes
    out["ids"] = ids.numpy()
    out["keys"] = [b.keys.numpy() for b in plain.blocks]
    for size in (0, CACHE):
        fetcher = FeatureFetcher(part, sample_grid, cache_size=size)
        x = fetcher.fetch(ids)
        out[f"x{size}"] = x.numpy()
        out[f"stats{size}"] = dict(fetcher.stats)
        out[f"cache_ids{size}"] = fetcher.cache_ids.numpy()
    # layer-wise inference over the parts
    model = BlockGNN(5, 8, 3, num_layers=2, dropout=0.0)
    model.load_state_dict(state)
    out["logits"] = distributed_inference(model, part, part.ndata["feat"], grid).numpy()
    # one training step through gnnpar.shard (stage 0): the summed loss scaled by
    # data size / global count, so that the averaged gradient is the global mean's
    model.train()
    dp = shard(model, grid, 0)
    y = FeatureFetcher(part, sample_grid, key="label").fetch(plain.seeds)  # seeds anywhere
    total = torch.tensor([plain.num_seeds])
    comm.all_reduce(total, grid, "data")
    loss = F.cross_entropy(model(plain.blocks, out_x := fetcher.fetch(ids)), y, reduction="sum")
    (loss * grid.size("data") / int(total)).backward()
    out["total"] = int(total)
    out["grads"] = {k: p.grad.numpy() for k, p in model.named_parameters()}
    dp.remove()
    out["x_again"] = out_x.numpy()
    # communication-free vertex sampling: each rank builds the rows it owns
    vs = VertexSampler(
        (part.indptr, part.indices),
        VERTICES,
        2,
        num_nodes=part.num_nodes,
        row_start=part.start,
        col_ids=part.local_to_global,
    )
    with comm.record(sample_grid) as traffic:
        share = vs.sample(KEY, owned=(part.start, part.stop)).blocks[0]
    out["vertex"] = _np([share])[0]
    out["vertex_bytes"] = traffic.bytes()
    # global batches: every rank holds its own nodes, knows every node's original id
    keys = part.orig_ids[: part.num_owned]
    all_keys = comm.all_gather(keys, grid, "data", sizes=comm.gather_sizes(len(keys), grid, "data"))
    sampler = DistNeighborSampler(part, [2], sample_grid)
    loader = NodeLoader(sampler, part.owned_nodes, 7, seed=3, keys=keys, all_keys=all_keys)
    out["batches"] = [b.numpy() for b in loader.epoch_batches(1)]
    out["global_sizes"] = loader.global_sizes()
    # a rank that loads another rank's part gets a clear error
    try:
        DistNeighborSampler(LocalPart.load(folder, (r + 1) % part.num_parts), [2], grid)
    except ValueError as err:
        out["error"] = str(err)
    return out


def _to_torch(blocks) -> list[tuple]:
    return [
        tuple(torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in b) for b in blocks
    ]


@pytest.mark.parametrize("num_parts", [2, 4])
def test_distributed_matches_single_process(tmp_path, num_parts):
    g = graph(weighted=num_parts == 2)
    folder = tmp_path / f"parts-{num_parts}"
    part = partitioners.partition(g, num_parts, method="metis", seed=0)
    partitioners.write(g, part, folder, halo=1)
    node_map = torch.from_numpy(np.array(partitioners.load_node_map(folder)))
    orig = torch.empty_like(node_map)
    orig[node_map] = torch.arange(node_map.numel())  # orig[new id] = original id
    seeds = seed_sets(num_parts, g.num_nodes)
    state = model_state()
    results = run_distributed(
        _rank_checks, num_parts, str(folder), [node_map[s] for s in seeds], state, timeout=240
    )

    # sampling: exactly the blocks of one process on the whole graph, same seeds and key
    for r, res in enumerate(results):
        for name, (fanouts, replace) in SAMPLERS.items():
            want = NeighborSampler(g, fanouts, replace=replace).sample(seeds[r], key=KEY + r)
            got = _to_torch(res[name])
            assert len(got) == len(want.blocks)
            for (src, num_dst, indptr, indices), w, b in zip(
                got, res[f"{name} weights"], want.blocks, strict=True
            ):
                assert torch.equal(orig[src], b.src_nodes), (name, r)
                assert num_dst == b.num_dst
                assert torch.equal(indptr, b.indptr) and torch.equal(indices, b.indices)
                assert (w is None) == (g.edge_weight is None) == (b.weight is None)
                assert w is None or torch.equal(torch.from_numpy(w), b.weight), (name, r)

    # features: the true rows; cache accounting
    parts = [LocalPart.load(folder, r) for r in range(num_parts)]
    starts = parts[0].starts
    row_bytes = g.feat.shape[1] * g.feat.element_size()
    misses = {}
    for r, res in enumerate(results):
        ids = torch.from_numpy(res["ids"])
        want = g.feat[orig[ids]].numpy()
        for size in (0, CACHE):
            np.testing.assert_array_equal(res[f"x{size}"], want)
        np.testing.assert_array_equal(res["x_again"], want)
        owned = (ids >= starts[r]) & (ids < starts[r + 1])
        cache = torch.from_numpy(res[f"cache_ids{CACHE}"])
        halo = parts[r].halo_nodes
        assert cache.numel() == min(CACHE, halo.numel()) and bool(torch.isin(cache, halo).all())
        n = parts[r].num_owned
        freq = torch.bincount(
            parts[r].indices[: int(parts[r].indptr[n])], minlength=parts[r].local_to_global.numel()
        )[n:]
        in_cache = torch.isin(halo, cache)
        if bool((~in_cache).any()):
            assert int(freq[in_cache].min()) >= int(freq[~in_cache].max())
        hit = torch.isin(ids, cache) & ~owned
        for size, hits in ((0, 0), (CACHE, int(hit.sum()))):
            stats = res[f"stats{size}"]
            assert stats["requests"] == ids.numel() and stats["local"] == int(owned.sum())
            assert stats["remote"] == int((~owned).sum()) and stats["hits"] == hits
            assert stats["fetched"] == stats["remote"] - hits
        misses[r] = ids[~owned & ~hit]
    # bytes each rank sent in the cached fetch: counts, its id requests, the rows it served
    for r, res in enumerate(results):
        served = sum(int(((m >= starts[r]) & (m < starts[r + 1])).sum()) for m in misses.values())
        want = 8 * (num_parts - 1) + 8 * misses[r].numel() + row_bytes * served
        assert res[f"stats{CACHE}"]["bytes"] == want

    # inference over the parts = layer-wise inference on the whole graph
    model = BlockGNN(5, 8, 3, num_layers=2, dropout=0.0)
    model.load_state_dict(state)
    full = layerwise_inference(model, g)
    for r, res in enumerate(results):
        owned_orig = orig[parts[r].owned_nodes]
        np.testing.assert_allclose(res["logits"], full[owned_orig].numpy(), rtol=1e-5, atol=1e-6)

    # one step: gradients equal those of the summed loss over every rank's batch
    model.train()
    loss, total = 0.0, 0
    for r in range(num_parts):
        batch = NeighborSampler(g, SAMPLERS["plain"][0]).sample(seeds[r], key=KEY + r)
        logits = model(batch.blocks, g.feat[batch.input_nodes])
        loss = loss + F.cross_entropy(logits, g.label[batch.seeds], reduction="sum")
        total += batch.num_seeds
    (loss / total).backward()
    for res in results:
        assert res["total"] == total
        for k, p in model.named_parameters():
            np.testing.assert_allclose(res["grads"][k], p.grad.numpy(), rtol=1e-5, atol=1e-7)

    # vertex sampling: the owned shares together are the single-process induced block
    new_graph = g.permute(orig)  # new node i is original node orig[i]
    ref = VertexSampler(new_graph, VERTICES, 2).sample(KEY).blocks[0]
    want = set(
        zip(
            ref.src_nodes[ref.indices].tolist(),
            ref.dst_nodes[ref.dst_index()].tolist(),
            strict=True,
        )
    )
    got = set()
    for res in results:
        src, num_dst, indptr, indices = _to_torch([res["vertex"]])[0]
        dst = torch.repeat_interleave(src[:num_dst], indptr[1:] - indptr[:-1])
        got |= set(zip(src[indices].tolist(), dst.tolist(), strict=True))
        assert res["vertex_bytes"] == 0
    assert got == want

    # every block node carries its original id (the key of its dropout masks)
    for res in results:
        for (src, *_), keys in zip(_to_torch(res["plain"]), res["keys"], strict=True):
            assert torch.equal(orig[src], torch.from_numpy(keys))
    # global batches: the ranks' shares of batch i are together the one-process batch i
    single = NodeLoader(NeighborSampler(g, [2]), torch.arange(g.num_nodes), 7, seed=3)
    want = single.epoch_batches(1)
    for i, batch in enumerate(want):
        shares = [orig[torch.from_numpy(res["batches"][i])] for res in results]
        assert sorted(torch.cat(shares).tolist()) == sorted(batch.tolist()), i
        assert all(res["global_sizes"][i] == batch.numel() for res in results)
    assert all(len(res["batches"]) == len(want) for res in results)
    assert all("does not fit" in res["error"] for res in results)
