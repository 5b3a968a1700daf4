"""Typed graphs over the parts of a partition: the distributed sampler draws per relation
exactly the blocks one process draws on the whole typed graph (same seeds and key, every
edge's relation and every source's type), and distributed inference of a typed model equals
layer-wise inference on the whole graph (float64). One world of 2 ranks runs every check."""

from __future__ import annotations

import numpy as np
import torch

import partitioners
from gnnpar.models.hetero import TypedGNN
from gnnpar.sampling import NeighborSampler, layerwise_inference
from gnnpar.testing import run_distributed

FANOUTS = "3,cites:2/*:1"
KEY = 77
MAG = {"num_papers": 160, "num_authors": 80, "num_institutions": 8, "num_fields": 9,
       "feat_dim": 5}  # fmt: skip


def _model(types) -> TypedGNN:
    torch.manual_seed(0)
    return TypedGNN(types, 6, 4, num_layers=2, kind="rgcn", dropout=0.0, num_bases=2).double()


def _rank(folder: str, seeds: list[torch.Tensor], state: dict) -> dict:
    import gnnpar
    from gnnpar.sampling import DistNeighborSampler, LocalPart, distributed_inference

    grid = gnnpar.init()
    r = grid.rank("data")
    part = LocalPart.load(folder, r)
    batch = DistNeighborSampler(part, FANOUTS, gnnpar.init()).sample(seeds[r], key=KEY + r)
    blocks = [(b.keys.numpy(), b.num_dst, b.indptr.numpy(), b.indices.numpy(),
               b.edge_type.numpy(), b.node_type.numpy()) for b in batch.blocks]  # fmt: skip
    model = _model(part.types)
    model.load_state_dict(state)
    feat = part.ndata["feat"].double()
    logits = distributed_inference(model, part, feat, grid)
    return {"blocks": blocks, "logits": logits.numpy(), "orig": part.orig_ids.numpy()}


def test_typed_parts_sample_and_infer_as_one_process(tmp_path):
    import gnnpar.data

    g = gnnpar.data.load("mag-synth", **MAG)
    part = partitioners.partition(g, 2, method="metis", seed=0)
    partitioners.write(g, part, tmp_path / "parts", halo=1)
    node_map = torch.from_numpy(np.array(partitioners.load_node_map(tmp_path / "parts")))
    papers = g.types.global_ids("paper", torch.arange(MAG["num_papers"]))
    seeds = [papers[torch.randperm(papers.numel(), generator=torch.Generator().manual_seed(r))
                    [:9]] for r in range(2)]  # fmt: skip
    model = _model(g.types)
    state = model.state_dict()
    results = run_distributed(
        _rank, 2, str(tmp_path / "parts"), [node_map[s] for s in seeds], state, timeout=240
    )
    for r, res in enumerate(results):
        want = NeighborSampler(g, FANOUTS).sample(seeds[r], key=KEY + r).blocks
        for got, b in zip(res["blocks"], want, strict=True):
            keys, num_dst, indptr, indices, etype, ntype = (torch.from_numpy(a) if
                isinstance(a, np.ndarray) else a for a in got)  # fmt: skip
            assert torch.equal(keys, b.src_nodes) and num_dst == b.num_dst
            assert torch.equal(indptr, b.indptr) and torch.equal(indices, b.indices)
            assert torch.equal(etype, b.edge_type) and torch.equal(ntype, b.node_type)
    whole = layerwise_inference(model.eval(), g, features=g.feat.double())
    for res in results:
        owned = torch.from_numpy(res["orig"])[: res["logits"].shape[0]]
        torch.testing.assert_close(torch.from_numpy(res["logits"]), whole[owned],
                                   rtol=1e-12, atol=1e-12)  # fmt: skip
