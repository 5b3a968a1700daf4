"""Activation checkpointing (:mod:`gnnpar.recompute`): GPT training with full and selective
recompute equals the plain run, composed with 3D tensor parallelism and ZeRO-3 over data, and
the recompute's extra bytes equal formulas written here; a full-graph 3D GCN/SAGE with
recompute equals the serial model and moves, in backward, its forward's bytes once more (one
world of 8 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gnnpar.models.gpt.model import GPT, GPTConfig, set_activation_checkpointing
from gnnpar.testing import run_distributed
from tests import fullgraph_utils as fg
from tests.byte_formulas import Bytes, gather_bytes, plexus_bytes

# dropout on: the recompute must draw the forward's masks again
CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.1)
BATCH, STEPS, LR = 8, 3, 1e-2
SPEC = {"data": 2, "x": 2, "z": 2}
STAGES = (0, 3)
MODES = ("none", "full", "selective")
TOL = 1e-12
# full-graph: odd sizes, nothing divides the 2×2×2 grid
N, DIMS = 23, {"gcn": [7, 5, 3], "sage": [7, 4, 3]}


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"] + 1), generator=g)


def _gpt_run(grid, stage: int, mode: str, fcdp: bool = False) -> dict:
    """Three AdamW steps of the GPT on ``grid``: the final parameters, the bytes per axis of
    the steps, and the data-axis bytes ZeRO-3's units should gather (their padded size)."""
    from gnnpar import comm, tensor
    from gnnpar.models.gpt.model import Block
    from gnnpar.shard import FCDP, by_type, shard

    torch.manual_seed(0)
    par = tensor.parallelize(GPT(GPTConfig(**CFG)).double(), grid)
    set_activation_checkpointing(par, mode)
    dp = shard(par, grid, stage, units=by_type(Block), fcdp=FCDP() if fcdp else None)
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=LR))
    shards = grid.size("data") * grid.size("z")
    index = grid.rank("z") + grid.size("z") * grid.rank("data")
    rows = slice(index * BATCH // shards, (index + 1) * BATCH // shards)
    torch.manual_seed(1)  # the dropout masks
    with comm.record(grid) as traffic:
        for step in range(STEPS):
            ids = _batch(step)[rows]
            tensor.cross_entropy(par(ids[:, :-1]), ids[:, 1:], par.lm_head).backward()
            opt.step()
            opt.zero_grad()
    padded = sum(g.padded for u in dp.stage3.units for g in u.groups.values()) if stage else 0
    return {
        "params": {k: v.detach().numpy().copy() for k, v in dp.full_state_dict().items()},
        "bytes": traffic.as_dict(),
        "gathers": traffic.calls(axis="data", kind="all_gather"),
        "padded": padded,
    }


def _pipeline_run(world, mode: str) -> dict:
    """Three steps of the GPT as a 1F1B pipeline of 2 stages on ``pipe=2,data=2,x=2``,
    ZeRO-3 (the chunks run their blocks with the recompute too)."""
    import gnnpar
    from gnnpar import tensor
    from gnnpar.models.gpt.model import Block
    from gnnpar.models.gpt.pipeline import gpt_pipeline
    from gnnpar.shard import by_type, shard

    grid = gnnpar.reshape(world, pipe=2, data=2, x=2)
    torch.manual_seed(0)
    model = tensor.parallelize(GPT(GPTConfig(**CFG)).double(), grid)
    set_activation_checkpointing(model, mode)
    head = model.lm_head
    pipe = gpt_pipeline(model, grid, "1f1b", 2,
                        shard_fn=lambda c: shard(c, grid, 3, units=by_type(Block)))  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    rows = slice(grid.rank("data") * BATCH // 2, (grid.rank("data") + 1) * BATCH // 2)
    def loss_fn(logits, y):
        return tensor.cross_entropy(logits, y, head) / 2, 0.0

    torch.manual_seed(1)
    for step in range(STEPS):
        ids = _batch(step)[rows]
        pipe.step(list(ids[:, :-1].chunk(2)), list(ids[:, 1:].chunk(2)), loss_fn, torch.float64)
        opt.step()
        opt.zero_grad()
        pipe.sync_params()
    params = {}
    for dp in pipe.dps:
        params.update({k: v.detach().numpy().copy() for k, v in dp.full_state_dict().items()})
    return {"params": params}, grid


def _recompute_bytes() -> Bytes:
    """The forward collectives of every block once more per step (x = 2, z = 2, y = 1: each
    projection's weight piece all-gathered over z; attention's and the MLP's output
    projections all-reduce their output, tokens × h, over x), float64."""
    h, layers, e = CFG["n_embd"], CFG["n_layer"], 8
    tokens = BATCH // (SPEC["data"] * SPEC["z"]) * CFG["block_size"]
    x, z = SPEC["x"], SPEC["z"]
    out = Bytes()
    for _ in range(STEPS * layers):
        for rows, cols in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)):
            out.add("z", "all_gather", z, rows * cols * e // x)  # z pieces of the x·y block
        for _ in range(2):
            out.add("x", "all_reduce", x, tokens * h * e)
    return out


def _minus(a: dict, b: dict) -> dict:
    """``a − b`` of two ``Traffic.as_dict()`` results (zeros left out)."""
    out: dict = {}
    for axis in set(a) | set(b):
        for kind in set(a.get(axis, {})) | set(b.get(axis, {})):
            d = a.get(axis, {}).get(kind, 0) - b.get(axis, {}).get(kind, 0)
            if d:
                out.setdefault(axis, {})[kind] = d
    return out


def _gcn_check(grid, kind: str) -> dict:
    """The 3D full-graph model with full recompute: logits and gradients equal the serial
    model's; forward bytes equal plain forward's, backward bytes plain backward's plus the
    forward's (measured, formula and the model's own schedule)."""
    from gnnpar import comm
    from gnnpar.models.fullgraph import parallelize_fullgraph

    a, x, y, train = fg.small_graph(n=N)
    a_hat = fg.normalise(a, kind)
    ref = fg.serial_model(kind, DIMS[kind], dropout=0.5)
    ref.train()
    logits = ref(fg.serial_adj(a_hat), x, dropout_seed=11)
    F.cross_entropy(logits[train], y[train]).backward()
    source = fg.make_source(a_hat, x, y, train, True)
    traffic, grads = {}, {}
    for mode in ("none", "full"):
        par = parallelize_fullgraph(ref, grid, source)
        par.activation_checkpointing = mode
        par.train()
        with comm.record(grid) as fwd:
            out = par(par.input_features(), dropout_seed=11)
        loss = par.loss(out)
        with comm.record(grid) as bwd:
            loss.backward()
        traffic[mode] = (fwd, bwd)
        grads[mode] = par.full_weights(grads=True)
        fg.check_schedule(fwd, bwd, par.expected_bytes(), f"{kind} {mode}")
    ids = source.node_ids(par.output_order, par.logits_rows)
    c0, c1 = par.logits_cols
    errs = [_rel(out.detach(), logits.detach()[ids][:, c0:c1])]
    for i, layer in enumerate(ref.layers):
        errs.append(_rel(grads["full"][i]["weight"], layer.stacked_weight_grad()))
        errs.append(_rel(grads["full"][i]["bias"], layer.bias.grad))
    f, b = plexus_bytes(grid.shape, grid.coords(), N, DIMS[kind], 2 if kind == "sage" else 1,
                        8, False, True)  # fmt: skip
    f.check(traffic["full"][0].as_dict(), f"{kind} forward")
    for axis, kinds in f.bytes.items():  # backward: its own, then the recompute's forward
        for k, v in kinds.items():
            b.bytes[axis][k] += v
            b.calls[axis][k] += f.calls[axis][k]
    b.check(traffic["full"][1].as_dict(), f"{kind} backward with recompute")
    extra = _minus(traffic["full"][1].as_dict(), traffic["none"][1].as_dict())
    assert extra == traffic["none"][0].as_dict(), (kind, extra)
    return {"err": max(errs)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _world() -> dict:
    import gnnpar

    world = gnnpar.init()
    grid = gnnpar.reshape(world, **SPEC)
    out = {"gpt": {}, "gcn": {}, "pipeline": {}}
    for stage in STAGES:
        for mode in MODES:
            out["gpt"][(stage, mode)] = _gpt_run(grid, stage, mode)
    # FCDP: the recompute's gather is served from the forward's cache
    out["gpt"][("fcdp", "full")] = _gpt_run(grid, 3, "full", fcdp=True)
    for mode in ("none", "full"):
        out["pipeline"][mode], grid = _pipeline_run(grid, mode)
    grid = gnnpar.reshape(grid, x=2, y=2, z=2)
    for kind in ("gcn", "sage"):
        out["gcn"][kind] = _gcn_check(grid, kind)
    gnnpar.shutdown(grid)
    return out


@pytest.fixture(scope="module")
def world():
    return run_distributed(_world, 8, timeout=600)


def test_checkpointed_gpt_trains_as_the_plain_one(world):
    for rank in world:
        for stage in (*STAGES, "fcdp"):
            plain = rank["gpt"][(3 if stage == "fcdp" else stage, "none")]["params"]
            for mode in ("full",) if stage == "fcdp" else ("full", "selective"):
                got = rank["gpt"][(stage, mode)]["params"]
                assert list(got) == list(plain)
                for key, want in plain.items():
                    assert _rel(torch.from_numpy(got[key]), torch.from_numpy(want)) <= TOL, (
                        stage, mode, key)  # fmt: skip


def test_checkpointed_pipeline_chunks_train_as_the_plain_ones(world):
    for rank in world:
        plain, got = rank["pipeline"]["none"]["params"], rank["pipeline"]["full"]["params"]
        assert list(got) == list(plain) and plain
        for key, want in plain.items():
            assert _rel(torch.from_numpy(got[key]), torch.from_numpy(want)) <= TOL, key


def test_recompute_bytes_equal_their_formulas(world):
    want = _recompute_bytes()
    for rank in world:
        for stage in STAGES:
            plain = rank["gpt"][(stage, "none")]
            # selective recomputes only the attention core: nothing moves again
            assert rank["gpt"][(stage, "selective")]["bytes"] == plain["bytes"]
            full = rank["gpt"][(stage, "full")]
            want.check(_minus(full["bytes"], plain["bytes"]), f"stage {stage} full recompute")
        # ZeRO-3: the recompute's gather of a block is the backward gather it had anyway:
        # each unit's padded chunks gathered twice a step (forward, backward), float64
        for mode in MODES:
            run = rank["gpt"][(3, mode)]
            gathered = run["bytes"]["data"]["all_gather"]
            formula = STEPS * 2 * gather_bytes(SPEC["data"], run["padded"] * 8)
            assert abs(gathered - formula) <= run["gathers"], (mode, gathered, formula)
        # FCDP: the recompute rebuilds each unit from the forward's cache: one data-axis
        # gather a step, none in backward
        run = rank["gpt"][("fcdp", "full")]
        gathered = run["bytes"]["data"]["all_gather"]
        formula = STEPS * gather_bytes(SPEC["data"], run["padded"] * 8)
        assert abs(gathered - formula) <= run["gathers"], ("fcdp", gathered, formula)


def test_fullgraph_recompute_equals_the_serial_model_and_moves_the_forward_again(world):
    for rank in world:
        for kind, res in rank["gcn"].items():
            assert res["err"] <= TOL, (kind, res)


def test_modes_are_checked():
    model = GPT(GPTConfig(**CFG))
    with pytest.raises(ValueError, match="must be one of none, full, selective"):
        set_activation_checkpointing(model, "partial")
    with pytest.raises(ValueError, match="has no transformer block"):
        set_activation_checkpointing(torch.nn.Linear(2, 2), "full")


def test_the_option_is_checked_per_task_and_counted_by_the_planner():
    """One spelling as TOML key and flag; gcn refuses selective and gpt refuses it on GPT-2
    in one line; the planner keeps less with full recompute and adds its forward again."""
    from gnnpar.models.fullgraph.cost import GCNProblem, gcn_collectives
    from gnnpar.models.fullgraph.memory import gcn_memory
    from gnnpar.models.fullgraph.task import FullGraphConfig
    from gnnpar.models.gpt.cost import GPTProblem, gpt_collectives, gpt_compute_seconds, gpt_layout
    from gnnpar.models.gpt.memory import gpt_memory
    from gnnpar.models.gpt.model import GPTConfig as Sizes
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.plan.inputs import PlanError
    from gnnpar.plan.machines import get_machine
    from gnnpar.train.config import ConfigError, from_mapping

    key = "activation_checkpointing"
    assert from_mapping(GPTTaskConfig, {key: "selective"}).activation_checkpointing == "selective"
    from_mapping(FullGraphConfig, {key: "full"}).check()
    with pytest.raises(ConfigError, match="full-graph layers take none or full"):
        from_mapping(FullGraphConfig, {key: "selective"}).check()
    with pytest.raises(ConfigError, match="needs model = gpt"):
        from_mapping(GPTTaskConfig, {key: "full", "model": "hf-gpt2"}).check()
    with pytest.raises(ConfigError, match="must be one of none, full, selective"):
        from_mapping(GPTTaskConfig, {key: "some"}).check()
    with pytest.raises(PlanError, match="activation_checkpointing"):
        GCNProblem(100, 300, 8, 3, activation_checkpointing="selective")

    # the planner, on the tested run: the recompute's collectives are the formula's
    def gpt(mode):
        return GPTProblem(Sizes(**CFG), batch=BATCH, element_size=8, stage=3,
                          activation_checkpointing=mode)  # fmt: skip

    layout = gpt_layout(gpt("none"), SPEC)  # the modes share it (a meta model is slow)
    extra: dict = {}
    for c in gpt_collectives(gpt("full"), SPEC, layout=layout):
        if c.what.startswith("recompute: "):
            extra.setdefault(c.axis, {}).setdefault(c.kind, 0)
            extra[c.axis][c.kind] += c.total * STEPS
    _recompute_bytes().check(extra, "planner's recompute collectives")
    selective = gpt_collectives(gpt("selective"), SPEC, layout=layout)
    assert not any(c.what.startswith("recompute") for c in selective)
    mem = {m: gpt_memory(gpt(m), SPEC, layout)["activations"] for m in MODES}
    # full: the logits, each block's input (tokens × h) and one block's activations
    tokens = BATCH // (SPEC["data"] * SPEC["z"]) * CFG["block_size"]
    logits = 2 * tokens * CFG["vocab_size"] // SPEC["x"] * 4  # float32, and their softmax
    one_block = (mem["none"] - logits) / CFG["n_layer"]
    assert mem["selective"] == mem["none"] and one_block > tokens * CFG["n_embd"] * 8
    want = logits + CFG["n_layer"] * tokens * CFG["n_embd"] * 8 + one_block
    assert mem["full"] == pytest.approx(want)
    machine = get_machine("cpu", None)
    t = {m: sum(gpt_compute_seconds(gpt(m), SPEC, machine, layout).values()) for m in MODES}
    assert t["none"] < t["selective"] < t["full"]
    gcn = {m: GCNProblem(1000, 5000, 16, 4, hidden=32, activation_checkpointing=m)
           for m in ("none", "full")}  # fmt: skip
    shape = {"x": 2, "y": 2, "z": 2}
    assert gcn_memory(gcn["full"], shape)["activations"] < gcn_memory(gcn["none"], shape)[
        "activations"]  # fmt: skip
    plain, again = (gcn_collectives(gcn[m], shape) for m in ("none", "full"))
    recomputed = [c for c in again if c.what.startswith("recompute: ")]
    assert len(again) == len(plain) + len(recomputed) and recomputed
