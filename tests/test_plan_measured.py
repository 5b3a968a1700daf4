"""The planner's predicted bytes equal what gnnpar's comm accounting measures, per rank, per
axis and per collective kind, for every grid shape of 8 ranks: one full-graph training epoch
(3-layer GCN and 2-layer GraphSAGE, 3D) on every x·y·z shape, and one optimizer step of
the ``gpt`` task (tensor parallel, then ``gnnpar.shard`` at ZeRO stage 0 and stage 3) on every
data·x·y·z shape. One 8-rank world hosts all the grids. Sizes are small and odd (23 nodes,
widths 7/5/5/3, vocabulary 37, 9 positions) so chunks are uneven and padding shows."""

from __future__ import annotations

import torch

import gnnpar
from gnnpar import comm
from gnnpar.grid import factorizations
from gnnpar.models.fullgraph.cost import GCNProblem, gcn_collectives
from gnnpar.models.gpt.cost import GPTProblem, gpt_collectives
from gnnpar.plan.comm_model import bytes_by_axis_kind
from gnnpar.testing import run_distributed
from tests.fullgraph_utils import make_source, normalise, serial_model, small_graph

GPT_SIZES = {"vocab_size": 37, "block_size": 9, "n_layer": 2, "n_embd": 24, "n_head": 8}
GPT_BATCH = 8


def _compare(measured: dict, predicted: dict, what: str) -> None:
    if measured != predicted:
        raise AssertionError(f"{what}: measured {measured} != predicted {predicted}")


def _gcn_epoch(grid, kind: str, dims: list[int]) -> int:
    from gnnpar.models.fullgraph import parallelize_fullgraph

    a, x, y, train = small_graph()
    model = serial_model(kind, dims, dropout=0.5)
    par = parallelize_fullgraph(model, grid, make_source(normalise(a, kind), x, y, train, True))
    opt = torch.optim.Adam(par.parameters(), lr=0.01)
    feats = par.input_features()
    with comm.record(grid) as traffic:  # what FullGraphTask.train_step does
        par.train()
        opt.zero_grad(set_to_none=True)
        loss = par.loss(par(feats, dropout_seed=3), "train_mask")
        loss.backward()
        opt.step()
    problem = GCNProblem.from_widths(
        23,
        1,
        dims,
        model=kind,
        element_size=8,  # float64; bytes do not depend on nnz
    )
    predicted = bytes_by_axis_kind(gcn_collectives(problem, grid.shape, grid.coords()))
    _compare(traffic.as_dict(), predicted, f"{kind} {grid.describe()}")
    return 1


class _Tokens:
    """A corpus of random tokens (what the task needs of a tokenised text)."""

    vocab_size = GPT_SIZES["vocab_size"]

    def split(self, val_fraction: float):
        ids = torch.randint(0, self.vocab_size, (4000,), generator=torch.Generator().manual_seed(5))
        return ids, ids[:200]


def _gpt_step(grid, stage: int) -> int:
    from gnnpar.models.gpt.model import GPTConfig
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.spec import build_task

    cfg = GPTTaskConfig(
        **GPT_SIZES, batch_size=GPT_BATCH, grid=",".join(f"{a}={v}" for a, v in grid.shape.items()),
        zero_stage=stage, warmup=1, steps=2, sample_tokens=0,
    )  # fmt: skip
    task = build_task("gpt", cfg, corpus=_Tokens())
    with comm.record(task.grid) as traffic:
        task.train_step(0)
    problem = GPTProblem(GPTConfig(**GPT_SIZES), batch=GPT_BATCH, element_size=4, stage=stage)
    predicted = bytes_by_axis_kind(gpt_collectives(problem, grid.shape, grid.coords()))
    _compare(traffic.as_dict(), predicted, f"GPT step stage {stage} {grid.describe()}")
    gnnpar.release(task.grid)
    return 1


def _world() -> dict:
    done = {"gcn": 0, "sage": 0, "gpt": 0}
    for data, x, y, z in factorizations(8):
        grid = gnnpar.init(data=data, x=x, y=y, z=z)  # one grid (its groups) per shape
        if data == 1:
            done["gcn"] += _gcn_epoch(grid, "gcn", [7, 5, 5, 3])
            done["sage"] += _gcn_epoch(grid, "sage", [7, 4, 3])
        done["gpt"] += _gpt_step(grid, 0) + _gpt_step(grid, 3)
        gnnpar.release(grid)  # free the shape's gloo groups before the next one
    return done


def test_predicted_bytes_equal_measured_on_every_8_rank_grid():
    results = run_distributed(_world, 8, timeout=600)
    assert results == [{"gcn": 10, "sage": 10, "gpt": 40}] * 8
