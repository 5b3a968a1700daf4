"""Context parallelism: the context axis of the grid (rank order, folding into data), ring
attention against plain causal attention (serial simulation, float64, forward and backward,
odd chunk lengths), and the ``gpt`` task with a context axis training exactly as one process,
with the ring's bytes equal to their formula and to the planner's (one world of 8 ranks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gnnpar.grid import GridError, GridShape, fit_shape, parse_grid_spec
from gnnpar.testing import run_distributed

# 24 tokens: chunks of 3 (odd) on 4 context ranks, 6 on 2
SIZES = {"vocab_size": 37, "block_size": 24, "n_layer": 2, "n_embd": 8, "n_head": 2}
BATCH, STEPS = 4, 3
# (grid, ZeRO stage): context=4 (data=2 replicates it), with x and data, and at stage 3
RUNS = [("context=4,data=2", 0), ("context=2,x=2,data=2", 0), ("context=2,x=2,data=2", 3)]


# --------------------------------------------------------------------------- the grid axis
def test_rank_order_with_a_context_axis():
    g = GridShape(x=2, y=1, z=3, context=2, data=2, pipe=2)
    assert g.world_size == 48 and g.shape["context"] == 2
    for r in range(g.world_size):
        c = g.coords(r)
        assert r == c["x"] + 2 * (c["y"] + 1 * (c["z"] + 3 * (c["context"] + 2 * (c["data"]
                                  + 2 * c["pipe"]))))  # fmt: skip
    old = GridShape(x=2, z=2, data=2)  # without a context axis: as before, and no "context" key
    assert "context" not in old.shape
    strides = (1, 2, 2, 4, 4, 4, 8)  # x, y, z, expert, context, data, pipe
    for r in range(8):
        assert r == sum(v * s for v, s in zip(old.coords(r).values(), strides, strict=True))
    assert fit_shape(8, parse_grid_spec("context=2,x=2")) == {
        "data": 2, "x": 2, "y": 1, "z": 1, "pipe": 1, "context": 2, "expert": 1}  # fmt: skip
    with pytest.raises(GridError, match="context"):
        fit_shape(6, parse_grid_spec("context=4"))


def test_layout_is_load_balanced():
    from gnnpar.tensor.context import chunk_ids, positions, split_sequence

    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert positions(12, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    x = torch.arange(12).reshape(1, 12)
    assert split_sequence(x, 3, 0).tolist() == [[0, 1, 10, 11]]
    with pytest.raises(ValueError, match="2·context = 8"):
        positions(12, 4, 0)


# ------------------------------------------------------------------- serial ring attention
@pytest.mark.parametrize("c,chunk,tile", [(1, 3, None), (2, 5, None), (3, 3, None), (4, 1, None),
                                           (3, 3, 100)])  # fmt: skip
def test_ring_attention_equals_causal_attention(c, chunk, tile, monkeypatch):
    """``tile``: score tiles of 100 bytes, so the pairs run one sequence·head at a time."""
    from gnnpar.tensor import context
    from gnnpar.tensor.context import simulate_ring_attention

    if tile is not None:
        monkeypatch.setattr(context, "TILE_BYTES", tile)
    torch.manual_seed(c)
    t = 2 * c * chunk
    q, k, v = (torch.randn(2, 3, t, 5, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(want)
    want.backward(grad)
    got, grads = simulate_ring_attention(q.detach(), k.detach(), v.detach(), c, grad)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    for g, ref in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert (g - ref).abs().max() <= 1e-12 * ref.abs().max()


def test_context_axis_is_refused_where_it_cannot_work():
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.config import ConfigError
    from gnnpar.train.loop import check_world
    from gnnpar.train.spec import get

    class GCNLike:  # a task config without pipelining (every task but gpt)
        grid = "context=2"

    with pytest.raises(ConfigError, match="a context axis needs the gpt task"):
        check_world(get("gcn"), GCNLike(), 2)
    for bad, match in (
        (dict(grid="context=2,pipe=2"), "does not combine with pipe"),
        (dict(grid="context=2", model="hf-gpt2"), "needs model = gpt"),
        (dict(grid="context=2", dropout=0.1), "'dropout' must be 0"),
        (dict(grid="context=4", block_size=12), "multiple of 2·context = 8"),
    ):
        with pytest.raises(ConfigError, match=match):
            GPTTaskConfig(**bad).check()


# ------------------------------------------------------------------------------- the world
class _Tokens:
    """A corpus of random tokens (what the task needs of a tokenised text)."""

    vocab_size = SIZES["vocab_size"]

    def split(self, val_fraction: float):
        ids = torch.randint(0, self.vocab_size, (3000,), generator=torch.Generator().manual_seed(5))
        return ids, ids[:600]


def _config(spec: str | None, stage: int):
    from gnnpar.models.gpt.task import GPTTaskConfig

    return GPTTaskConfig(
        **SIZES, batch_size=BATCH, grid=spec or "data=1", zero_stage=stage, dtype="float64",
        steps=STEPS, warmup=1, lr=1e-2, sample_tokens=0, val_batches=1,
    )  # fmt: skip


def _saved_bytes(task, step: int) -> tuple[float, int]:
    """Run ``step`` and return what autograd saved for backward on this rank (bytes of the
    distinct storages, parameters left out), and the loss."""
    params = {p.untyped_storage().data_ptr() for p in task.net.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = task.train_step(step)["loss"]
    return loss, sum(seen.values())


def _train(spec: str | None, stage: int) -> dict:
    """Three steps of the gpt task on ``spec``: full parameters, losses, ring bytes, and the
    bytes autograd saved in the first step beside the planner's activation memory."""
    import gnnpar
    from gnnpar import comm
    from gnnpar.models.gpt.memory import gpt_memory
    from gnnpar.models.gpt.task import plan_problem
    from gnnpar.train.spec import build_task

    task = build_task("gpt", _config(spec, stage), corpus=_Tokens())
    losses, predicted, measured = [], None, None
    memory = gpt_memory(dataclasses.replace(plan_problem(task.cfg), stage=stage), task.grid.shape)
    with comm.record(task.grid) as traffic:
        loss, saved = _saved_bytes(task, 0)
        losses.append(loss)
        for step in range(1, STEPS):
            losses.append(task.train_step(step)["loss"])
    ring = traffic.bytes(axis="context", kind="p2p")
    other = traffic.bytes(axis="context") - ring
    val = task.evaluate(STEPS)["val_loss"]
    params = {k: v.detach().cpu().numpy() for k, v in task.dp.full_state_dict().items()}
    if spec is not None:
        from gnnpar.models.gpt.cost import gpt_collectives
        from gnnpar.plan.comm_model import bytes_by_axis_kind

        problem = dataclasses.replace(plan_problem(task.cfg), stage=stage)
        predicted = bytes_by_axis_kind(
            gpt_collectives(problem, task.grid.shape, task.grid.coords())
        )
        measured = traffic.as_dict()
    out = {"params": params, "losses": losses, "val": val, "ring": ring, "other": other,
           "grid": task.grid.shape, "predicted": predicted, "measured": measured,
           "saved": saved,
           "activations": memory["activations"] + memory.get("ring", 0.0)}  # fmt: skip
    gnnpar.release(task.grid)
    return out


def _world() -> list[dict]:
    import torch.distributed as dist

    import gnnpar
    from gnnpar.grid import fold_context

    grid = gnnpar.init(context=2, x=2, data=2)
    # the context group of this rank, and the folded data groups: the same ranks
    c = grid.coords()
    want = [c["x"] + 2 * (i + 2 * c["data"]) for i in range(2)]
    assert grid.ranks("context") == want == dist.get_process_group_ranks(grid.group("context"))
    folded = fold_context(grid)
    assert folded.ranks("data") == grid.ranks("context_data")
    assert folded.rank("data") == c["context"] + 2 * c["data"]
    gnnpar.release(grid)
    return [_train(spec, stage) for spec, stage in RUNS]


@pytest.fixture(scope="module")
def world_results():
    return run_distributed(_world, 8, timeout=600)


@pytest.fixture(scope="module")
def reference():
    """The plain one-process run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(None, 0)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[f"{s} stage {z}" for s, z in RUNS])
def test_training_equals_one_process(world_results, reference, i):
    spec, want = RUNS[i][0], reference
    for per_rank in world_results:
        got = per_rank[i]
        assert got["grid"]["context"] == parse_grid_spec(spec)["context"]
        for name, ref in want["params"].items():
            ref, value = torch.from_numpy(ref), torch.from_numpy(got["params"][name])
            assert (value - ref).abs().max() <= 1e-12 * ref.abs().max(), name
        for a, b in zip(got["losses"] + [got["val"]], want["losses"] + [want["val"]],
                        strict=True):  # fmt: skip
            assert abs(a - b) <= 1e-12 * abs(b)


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[f"{s} stage {z}" for s, z in RUNS])
def test_ring_bytes_equal_the_formula_and_the_planner(world_results, i):
    from gnnpar.tensor.context import ring_bytes

    spec, _ = RUNS[i]
    shape = fit_shape(8, parse_grid_spec(spec))
    c, t = shape["context"], SIZES["block_size"]
    rows = BATCH // (shape["data"] * shape["z"])
    heads = SIZES["n_head"] // shape["x"]  # attention heads split over x (column, then row)
    head_dim = SIZES["n_embd"] // SIZES["n_head"]
    keys = rows * heads * (t // c) * head_dim * 8  # this rank's keys (float64)
    # forward: C-1 hops of keys and values; backward: C-1 hops of them, C of their gradients
    per_layer = 2 * (c - 1) * keys + (2 * (c - 1) + 2 * c) * keys
    assert sum(ring_bytes(keys, c)) == per_layer
    for per_rank in world_results:
        got = per_rank[i]
        assert got["ring"] == STEPS * SIZES["n_layer"] * per_layer
        # besides the ring: the loss mean over context, one float64 all-reduce a step
        assert got["other"] == STEPS * round(2 * (c - 1) / c * 8)
        per_step = {a: {k: STEPS * v for k, v in kinds.items()}
                    for a, kinds in got["predicted"].items()}  # fmt: skip
        assert got["measured"] == per_step, (got["measured"], per_step)


# ------------------------------------------------------------------------------ the planner
# ZeRO-3's gathered parameters live in storages the hook cannot tell from activations
STAGE0 = [i for i, (_, stage) in enumerate(RUNS) if stage == 0]


@pytest.mark.parametrize("i", [None, *STAGE0], ids=["one process", *(RUNS[i][0] for i in STAGE0)])
def test_planner_activation_memory_matches_what_autograd_saves(world_results, reference, i):
    """The planner's per-rank activation memory (Megatron's count with this rank's tokens,
    plus the ring's blocks) against the bytes autograd actually saved in a step, on this
    model: one process, and each context grid (which holds a quarter or half the tokens)."""
    runs = [reference] if i is None else [r[i] for r in world_results]
    for got in runs:
        assert 0.8 <= got["saved"] / got["activations"] <= 1.25, (got["saved"], got["activations"])


def test_longest_sequence_grows_with_the_context_axis():
    """``gnnpar plan gpt --longest-sequence``: the answer fits and one chunk pair more does
    not; four context ranks hold more than twice the sequence of one rank (batch 1), less than
    four times (the replicated model, and the ring's score tiles, 3·L² per head and sequence
    with L = T/8, where one rank's fused attention keeps none)."""
    from gnnpar.models.gpt.cost import GPTProblem
    from gnnpar.models.gpt.memory import gpt_memory
    from gnnpar.models.gpt.planning import longest_sequence
    from gnnpar.plan import get_machine
    from gnnpar.plan.memory import USABLE_FRACTION

    problem = GPTProblem.sized(4, 256, 8, seq=64, vocab=512, batch=1, element_size=4)
    machine = dataclasses.replace(get_machine("cpu"), memory_gb=0.2)
    usable = USABLE_FRACTION * 0.2e9
    one, best_one = longest_sequence(problem, 1, machine, (0,))
    four, best = longest_sequence(problem, 4, machine, (0,), {"context": 4, "data": 1})
    assert best.shape["context"] == 4 and best_one is not None
    for seq, shape in ((four, best.shape), (one, best_one.shape)):
        step = 2 * shape.get("context", 1)
        for s, fits in ((seq, True), (seq + step, False)):
            p = dataclasses.replace(problem, model=dataclasses.replace(problem.model, block_size=s))
            assert (sum(gpt_memory(p, shape).values()) <= usable) == fits, (s, shape)
    assert 2.0 * one <= four <= 4.0 * one, (one, four)
