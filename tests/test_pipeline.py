"""Pipeline parallelism: schedules (deadlock, order, in-flight bound), stage splits, the pipe
axis of the grid, and pipelined training of our GPT and of HF GPT-2 equal to one process (one
world of 8 ranks)."""

from __future__ import annotations

import functools

import pytest
import torch

from gnnpar.grid import GridError, GridShape, fit_shape, parse_grid_spec
from gnnpar.models.gpt.model import GPT, GPTConfig
from gnnpar.pipeline.schedule import (
    SCHEDULES,
    ScheduleError,
    bubble_fraction,
    check_sizes,
    peak_bound,
    program,
    simulate,
    verify,
)
from gnnpar.pipeline.stages import split_layers
from gnnpar.testing import run_distributed

CFG = dict(vocab_size=32, block_size=8, n_layer=8, n_head=2, n_embd=8, dropout=0.0)
BATCH, SEQ, STEPS, LR = 16, 8, 3, 1e-2

# (grid, schedule, micro-batches, virtual stages, ZeRO stage, tied)
RUNS = [
    ("pipe=2,data=4", "gpipe", 4, 1, 0, True),
    ("pipe=2,data=4", "1f1b", 4, 1, 0, True),
    ("pipe=2,data=4", "interleaved", 4, 2, 0, True),
    ("pipe=4,data=2", "gpipe", 4, 1, 0, True),
    ("pipe=4,data=2", "1f1b", 8, 1, 0, True),
    ("pipe=4,data=2", "interleaved", 4, 2, 0, True),
    ("pipe=2,data=4", "1f1b", 2, 1, 3, True),
    ("pipe=2,data=4", "1f1b", 4, 1, 0, False),
    ("pipe=2,data=2,x=2", "1f1b", 4, 1, 0, True),
    ("pipe=2,data=2,x=2", "interleaved", 4, 2, 3, True),
    ("pipe=2,x=2,z=2", "gpipe", 4, 1, 0, True),
]
# transformers' GPT2LMHeadModel of the same sizes, pipelined by HFGPT2Chunk
HF_CFG = dict(vocab_size=32, n_positions=8, n_layer=4, n_head=2, n_embd=8, resid_pdrop=0.0,
              embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
HF_RUNS = [
    ("pipe=2,data=4", "1f1b", 4, 1, 0, True),
    ("pipe=2,data=2,x=2", "1f1b", 4, 1, 3, True),
]
#: (run, HF GPT-2) for every pipelined run of the world
ALL = [(r, False) for r in RUNS] + [(r, True) for r in HF_RUNS]
ALL_IDS = [("hf-gpt2 " if hf else "") + " ".join(map(str, r)) for r, hf in ALL]


# ------------------------------------------------------------------ one process: schedules
def _combos():
    for schedule in SCHEDULES:
        for p in (2, 3, 4, 8):
            for m in (1, 2, 3, 4, 8, 12):
                for v in (1,) if schedule != "interleaved" else (2, 3):
                    try:
                        check_sizes(schedule, p, m, v)
                    except ScheduleError:
                        continue
                    yield schedule, p, m, v


def test_every_schedule_is_deadlock_free_and_holds_its_bound():
    checked = 0
    for schedule, p, m, v in _combos():
        for tied in (False, True):
            peaks = verify(program(schedule, p, m, v, tied=tied))
            assert peaks == [peak_bound(schedule, p, m, v, r) for r in range(p)], (
                schedule, p, m, v, peaks)  # fmt: skip
            verify(program(schedule, p, m, v, tied=tied, forward_only=True))
            checked += 1
    assert checked == 2 * len(list(_combos())) > 100


def test_the_timeline_of_every_program_has_the_formula_bubble():
    for schedule, p, m, v in _combos():
        step, idle = simulate(program(schedule, p, m, v, tied=True), 1.0 / v, 2.0 / v)
        assert step == pytest.approx(3.0 * (m * v + p - 1) / v)
        assert idle == pytest.approx([bubble_fraction(p, m, v)] * p), (schedule, p, m, v)
    # a message's latency adds to the critical path: more messages, more of it
    slow = [simulate(program(s, 4, 8, v), 1 / v, 2 / v, 0.05)[1][0] for s, v in
            (("1f1b", 1), ("interleaved", 2))]  # fmt: skip
    assert slow[0] > bubble_fraction(4, 8) and slow[1] > bubble_fraction(4, 8, 2)


def test_every_pass_runs_once_and_backward_follows_forward():
    for schedule, p, m, v in _combos():
        for r, ops in enumerate(program(schedule, p, m, v)):
            passes = [(o.kind, o.mb, o.chunk) for o in ops if o.kind in "FB"]
            want = {(k, i, c) for k in "FB" for i in range(m) for c in range(v)}
            assert sorted(passes) == sorted(want), (schedule, p, m, v, r)
            for k, i, c in passes:
                if k == "B":
                    assert passes.index(("F", i, c)) < passes.index((k, i, c))


def test_verify_catches_a_deadlock_and_a_swapped_order():
    progs = program("1f1b", 2, 4)
    # rank 1 waits for its second activation before the first: the channel order is broken
    bad = [list(progs[0]), list(progs[1])]
    recvs = [i for i, o in enumerate(bad[1]) if o.kind == "recv"]
    bad[1][recvs[0]], bad[1][recvs[1]] = bad[1][recvs[1]], bad[1][recvs[0]]
    with pytest.raises(ScheduleError, match="comes first"):
        verify(bad)
    # both ranks receive before they send: a deadlock
    first_send = next(i for i, o in enumerate(progs[0]) if o.kind == "send")
    grad_recv = next(o for o in progs[0] if o.kind == "recv")
    dead = [[grad_recv, *progs[0][:first_send]], progs[1]]
    with pytest.raises(ScheduleError, match="deadlock"):
        verify(dead)


def test_bubble_and_bounds():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert [peak_bound("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert [peak_bound("gpipe", 4, 8, 1, r) for r in range(4)] == [8] * 4
    with pytest.raises(ScheduleError, match="divisible"):
        check_sizes("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="interleaved"):
        check_sizes("1f1b", 4, 8, 2)


def test_split_layers_by_count_and_cost():
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    # a costly head pushes layers off the last stage
    assert split_layers(8, 2, [1.0] * 8, 0.0, 4.0) == [range(0, 6), range(6, 8)]
    assert split_layers(6, 3, [1, 1, 4, 1, 1, 1]) == [range(0, 2), range(2, 3), range(3, 6)]
    with pytest.raises(ValueError, match="cannot fill"):
        split_layers(2, 3)


def test_the_tied_weight_is_sent_from_a_copy(monkeypatch):
    """The tied embedding's send runs in the background while ZeRO-3 frees the gathered
    weight after the forward: the send must read a copy, not the weight's storage (sending
    the weight itself made one CI run end with a wrong embedding)."""
    from gnnpar import comm
    from gnnpar.pipeline.runtime import TiedWeight

    class Grid:
        def size(self, axis):
            return 2

    sent = []
    monkeypatch.setattr(comm, "send", lambda t, *a, **k: sent.append(t))
    tie = TiedWeight(Grid(), (4, 3), torch.float64)
    weight = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    tie.due_send(7)
    tie.watch(weight)
    assert sent[0].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    weight.untyped_storage().resize_(0)  # what ZeRO-3 does to a gathered weight
    assert torch.equal(sent[0], torch.arange(12, dtype=torch.float64).reshape(4, 3))


def test_pipe_axis_rank_order():
    old = GridShape(x=2, y=1, z=2, data=2)
    assert old.shape == {"x": 2, "y": 1, "z": 2, "data": 2}  # no pipe key without a pipe
    for r in range(old.world_size):
        c = old.coords(r)
        assert r == c["x"] + 2 * (c["y"] + 1 * (c["z"] + 2 * c["data"])) and c["pipe"] == 0
    g = GridShape(x=2, data=2, pipe=3)
    assert g.world_size == 12 and g.shape["pipe"] == 3
    for r in range(12):
        c = g.coords(r)
        assert r == c["x"] + 2 * (c["data"] + 2 * c["pipe"])
    assert fit_shape(16, parse_grid_spec("pipe=2,x=2")) == {
        "data": 4, "x": 2, "y": 1, "z": 1, "pipe": 2, "context": 1, "expert": 1}  # fmt: skip
    with pytest.raises(GridError, match="pipe"):
        fit_shape(6, parse_grid_spec("pipe=4"))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_hf_gpt2_chunks_give_the_models_logits(attention):
    """Two HF GPT-2 chunks, the first with the embeddings, the second with the head, give the
    model's own logits, with the causal mask eager attention needs; an attention that takes no
    mask is refused in one line."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gnnpar.models.gpt.hf_gpt2 import HFGPT2Chunk, check_hf_gpt2

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**HF_CFG, attn_implementation=attention)).double()
    check_hf_gpt2(model)
    first = HFGPT2Chunk(model, range(0, 1), True, False)
    last = HFGPT2Chunk(model, range(1, 4), False, True)
    ids = _batch(0)[:4, :-1]
    with torch.no_grad():
        want, got = model(ids).logits, last(first(ids))
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    assert sorted({*first.state_dict(), *last.state_dict()}) == sorted(model.state_dict())
    model.config._attn_implementation = "flash_attention_2"  # what the check reads
    with pytest.raises(ValueError, match="takes no additive causal mask"):
        check_hf_gpt2(model)


# ------------------------------------------------------------ the world: pipelined training
def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CFG["vocab_size"], (BATCH, SEQ + 1), generator=g)


def _model(tied: bool, hf: bool) -> torch.nn.Module:
    """Our GPT, or HF GPT-2 of the same sizes, in float64."""
    if hf:
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(**HF_CFG, tie_word_embeddings=tied)).double()
    return GPT(GPTConfig(**CFG, tie_weights=tied)).double()


@functools.cache
def _reference(m: int, tied: bool, hf: bool = False) -> dict[str, torch.Tensor]:
    """One process, the same global batch in ``m`` micro-batches, float64 (one thread: this
    tiny model runs 20× slower on two threads of a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(m, tied, hf)
    finally:
        torch.set_num_threads(threads)


def _reference_run(m: int, tied: bool, hf: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = _model(tied, hf)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        ids = _batch(step)
        for xm, ym in zip(ids[:, :-1].chunk(m), ids[:, 1:].chunk(m), strict=True):
            logits = model(xm).logits if hf else model(xm)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     ym.reshape(-1)) / m  # fmt: skip
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _train(world, spec, schedule, m, v, stage, tied, hf=False):
    import gnnpar
    from gnnpar import comm
    from gnnpar.models.gpt.model import Block
    from gnnpar.models.gpt.pipeline import gpt_pipeline
    from gnnpar.shard import by_type, shard
    from gnnpar.tensor import cross_entropy, parallelize

    grid = gnnpar.reshape(world, **parse_grid_spec(spec))
    torch.manual_seed(0)
    model = parallelize(_model(tied, hf), grid)
    head = model.lm_head
    block = type(model.transformer.h[0]) if hf else Block
    pipe = gpt_pipeline(
        model, grid, schedule, m, virtual=v,
        shard_fn=lambda chunk: shard(chunk, grid, stage, units=by_type(block)),
    )  # fmt: skip
    del model
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, weight_decay=0.1)
    # the batch is split over data and z (as the gpt task splits it)
    shards = grid.size("data") * grid.size("z")
    index = grid.rank("z") + grid.size("z") * grid.rank("data")
    rows = BATCH // shards

    def loss_fn(logits, y):
        loss = cross_entropy(logits, y, head) / m
        return loss, float(loss.detach())

    peaks, losses = [], []
    with comm.record(grid) as traffic:
        for step in range(STEPS):
            ids = _batch(step)[index * rows : (index + 1) * rows]
            res = pipe.step(list(ids[:, :-1].chunk(m)), list(ids[:, 1:].chunk(m)), loss_fn,
                            torch.float64)  # fmt: skip
            opt.step()
            opt.zero_grad()
            pipe.sync_params()
            peaks.append(res.peak_in_flight)
            losses.append(res.loss)
    params = {}
    for dp in pipe.dps:
        params.update({k: t.detach().cpu().numpy() for k, t in dp.full_state_dict().items()})
    # the pipe groups: consecutive stages are D·X·Y·Z ranks apart, and every other group
    # stays inside a stage
    import torch.distributed as dist

    members = grid.ranks("pipe")
    stride = grid.size("world") // grid.size("pipe")
    assert members == [grid.global_rank % stride + i * stride for i in range(grid.size("pipe"))]
    assert dist.get_process_group_ranks(grid.group("pipe")) == members
    total = comm.all_reduce(torch.tensor([float(grid.global_rank)]), grid, "pipe")
    assert total.item() == sum(members)
    for axis in ("data", "tensor"):
        assert {r // stride for r in grid.ranks(axis)} == {grid.global_rank // stride}
    out = {
        "pipe_rank": grid.rank("pipe"),
        "params": params,
        "peaks": peaks,
        "bound": pipe.pipeline.bound,
        "p2p": traffic.bytes(axis="pipe", kind="p2p"),
        "p2p_other_kinds": traffic.bytes(axis="pipe") - traffic.bytes(axis="pipe", kind="p2p"),
        "tensor": grid.size("tensor"),
        "losses": losses,
    }
    return out, grid


def _world():
    import gnnpar

    grid = gnnpar.init()
    results = []
    for run, hf in ALL:
        out, grid = _train(grid, *run, hf=hf)
        results.append(out)
    gnnpar.shutdown(grid)
    return results


@pytest.fixture(scope="module")
def world_results():
    from transformers import GPT2LMHeadModel  # noqa: F401 - imported once, before the fork

    return run_distributed(_world, 8, timeout=600)


@pytest.mark.parametrize("i", range(len(ALL)), ids=ALL_IDS)
def test_pipelined_training_equals_one_process(world_results, i):
    (spec, schedule, m, v, stage, tied), hf = ALL[i]
    want = _reference(m, tied, hf)
    seen = set()
    for per_rank in world_results:
        got = per_rank[i]
        for name, value in got["params"].items():
            ref, value = want[name], torch.from_numpy(value)
            err = (value - ref).abs().max() / ref.abs().max()
            assert err <= 1e-12, (name, float(err))
            seen.add(name)
    assert seen | ({"lm_head.weight"} if tied else set()) == set(want)


@pytest.mark.parametrize("i", range(len(ALL)), ids=ALL_IDS)
def test_p2p_bytes_and_in_flight_bound(world_results, i):
    (spec, schedule, m, v, stage, tied), _ = ALL[i]
    shape = fit_shape(8, parse_grid_spec(spec))
    p, rows = shape["pipe"], BATCH // (shape["data"] * shape["z"]) // m
    act = rows * SEQ * CFG["n_embd"] * 8  # one micro-batch's activation (or its gradient)
    for per_rank in world_results:
        got = per_rank[i]
        r = got["pipe_rank"]
        # v chunks send activations forward and gradients back, except at the two ends
        sends = m * (2 * v - (r == 0) - (r == p - 1))
        tie = CFG["vocab_size"] * CFG["n_embd"] * 8 // got["tensor"] if tied else 0
        want = STEPS * (sends * act + (tie if r in (0, p - 1) else 0))
        assert got["p2p"] == want, (r, got["p2p"], want)
        assert got["p2p_other_kinds"] == 0
        assert got["peaks"] == [peak_bound(schedule, p, m, v, r)] * STEPS == [got["bound"]] * 3


# ------------------------------------------------------------------------------ the planner
def _planned(spec, schedule, m, v, tied, batch=BATCH):
    from gnnpar.models.gpt.cost import GPTProblem
    from gnnpar.models.gpt.planning import rank_gpt
    from gnnpar.plan import get_machine

    problem = GPTProblem(
        GPTConfig(**CFG, tie_weights=tied), batch=batch, element_size=8, grad_clip=False,
        micro_batches=m, schedule=schedule, virtual=v,
    )  # fmt: skip
    shape = fit_shape(8, parse_grid_spec(spec))
    for c in rank_gpt(problem, 8, get_machine("cpu")):
        if {a: c.shape.get(a, 1) for a in shape} == shape:
            return c
    raise AssertionError(f"the planner has no candidate {spec}")


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[" ".join(map(str, r)) for r in RUNS])
def test_planner_p2p_bytes_equal_the_measured(world_results, i):
    spec, schedule, m, v, stage, tied = RUNS[i]
    c = _planned(spec, schedule, m, v, tied)
    assert c.fits and c.pipeline is not None
    assert c.pipeline.bubble == bubble_fraction(c.shape["pipe"], m, v)
    # the planner reports the rank that sends most
    assert c.bytes["pipe"] == max(r[i]["p2p"] for r in world_results) // STEPS


def test_planner_stage_memory_follows_the_schedule():
    gpipe = _planned("pipe=4,data=2", "gpipe", 8, 1, True)
    one = _planned("pipe=4,data=2", "1f1b", 8, 1, True)
    inter = _planned("pipe=4,data=2", "interleaved", 8, 2, True)
    # activations of m micro-batches in flight against p (1F1B) on the first stage
    assert gpipe.memory["activations"] / one.memory["activations"] == pytest.approx(8 / 4)
    # interleaved: 2(p-1) + (v-1)p + 1 = 11 chunk passes of half the layers each
    assert inter.memory["activations"] / one.memory["activations"] == pytest.approx(11 / 2 / 4)
    assert inter.compute["bubble"] < one.compute["bubble"] == gpipe.compute["bubble"]
    assert gpipe.memory["parameters"] == one.memory["parameters"]


def test_planner_shares_the_cores_among_stages():
    """Four ranks on the 2-core box: a pipeline stage computes a quarter of the step on half
    a core, like a data rank, then waits for the bubble, so data parallelism wins; the
    trainer without a grid (what the planner picks) keeps running without a pipeline."""
    from gnnpar.models.gpt.planning import choose_gpt_plan
    from gnnpar.models.gpt.task import GPTTaskConfig, plan_problem
    from gnnpar.plan import get_machine

    problem = plan_problem(GPTTaskConfig(grad_accum=4))
    shape, _ = choose_gpt_plan(problem, 4, get_machine("cpu"))
    assert shape.get("pipe", 1) == 1, shape
    piped = _planned_shape(problem, {"pipe": 2, "data": 2, "x": 1, "y": 1, "z": 1})
    flat = _planned_shape(problem, {"pipe": 1, "data": 4, "x": 1, "y": 1, "z": 1})
    work = sum(v for k, v in piped.compute.items() if k != "bubble")
    assert work == pytest.approx(flat.compute["gemm"], rel=0.2)


def _planned_shape(problem, shape):
    from gnnpar.models.gpt.planning import rank_gpt
    from gnnpar.plan import get_machine

    for c in rank_gpt(problem, 4, get_machine("cpu")):
        if {a: c.shape.get(a, 1) for a in shape} == shape:
            return c
    raise AssertionError(f"no candidate {shape}")


def test_a_pipe_axis_is_for_the_gpt_task_only():
    from gnnpar.models.fullgraph.task import FullGraphConfig
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.config import ConfigError
    from gnnpar.train.loop import check_world
    from gnnpar.train.spec import get

    with pytest.raises(ConfigError, match="pipe axis needs the gpt task"):
        check_world(get("gcn"), FullGraphConfig(grid="pipe=2,x=2"), 4)
    check_world(get("gpt"), GPTTaskConfig(grid="pipe=2,x=2"), 4)
    with pytest.raises(ConfigError, match="divisible by pipe"):
        GPTTaskConfig(grid="pipe=4", schedule="interleaved", grad_accum=6).check()
    with pytest.raises(ConfigError, match="n_layer"):
        GPTTaskConfig(grid="pipe=4", n_layer=3).check()
