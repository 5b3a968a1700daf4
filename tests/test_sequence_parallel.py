"""Sequence parallelism (``Plan(sequence_parallel=True)``, gnnpar/tensor/sequence.py): our GPT
and Llama equal to serial (float64 ≤ 1e-12, forward and backward, two SGD steps) on x=2, x=4,
data=2·x=2, context=2·x=2 and x=2 with activation checkpointing (our GPT also on x=2·y=2 and
x=2·z=2), at sizes that do not divide; the bytes of plain tensor parallelism (each all-reduce
an all-gather plus a reduce-scatter, by a formula written out below); activation memory per
rank falling with x as the planner predicts; per-shard dropout masks; one-line refusals; and
the trainer with ``--sequence-parallel --tp-overlap decompose`` on data=2,x=2 at ZeRO-3 equal
to the run without, resumed from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar import comm, tensor
from gnnpar.chunking import chunk_sizes
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.models.gpt.llama import Llama, LlamaConfig
from gnnpar.models.gpt.model import GPT, GPTConfig, set_activation_checkpointing
from gnnpar.testing import run_distributed
from tests.test_gpt import _full_grads

F64 = torch.float64
VOCAB = 37  # splits unevenly over x = 2 and 4
SP = tensor.Plan(sequence_parallel=True)


def _gpt(**kw) -> GPT:
    # width 20 and 4 heads of 5; MLP 80; a sequence of 9 splits 5/4 and 3/2/2/2
    cfg = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=20, **kw)
    torch.manual_seed(0)
    return GPT(cfg).to(F64)


def _llama(n_kv_head: int = 2, **kw) -> Llama:
    cfg = LlamaConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_head=n_kv_head,
                      n_embd=16, ffn_hidden=22, **kw)  # fmt: skip
    torch.manual_seed(0)
    return Llama(cfg).to(F64)


def _compare(make, grid, plan=SP, t: int = 9, batch: int = 4, checkpointing: str = "none"):
    """Two SGD steps of the serial and the sequence-parallel copy of ``make()`` (the batch
    over data·z, the sequence over context, then over x): the largest relative difference of
    the logits, the loss, every gradient and the final parameters, by what."""
    from gnnpar.grid import fold_context
    from gnnpar.shard import shard
    from gnnpar.tensor.context import context_parallel, positions, split_sequence

    serial, par = make(), tensor.parallelize(make(), grid, plan)
    context_parallel(par, grid)
    set_activation_checkpointing(par, checkpointing)
    _dp = shard(par, fold_context(grid), stage=0)  # the data (and context) reduction
    shards = grid.size("data") * grid.size("z")
    me = grid.rank("z") + grid.size("z") * grid.rank("data")
    rows = slice(me * batch // shards, (me + 1) * batch // shards)
    c, r = grid.size("context"), grid.rank("context")
    ids = torch.randint(0, VOCAB, (2, batch, t + 1), generator=torch.Generator().manual_seed(5))
    # plain SGD, by hand: AdamW would turn the roundoff of gradients that are zero (the key
    # biases') into updates of lr size on either side, and torch's optimizers import dynamo
    # (seconds) in every forked rank
    worst = {}

    def rel(a, b, what):
        err = float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)
        worst[what] = max(worst.get(what, 0.0), err)

    for step in range(2):
        x, y = ids[step, :, :-1], ids[step, :, 1:]
        logits_s = serial(x)
        loss_s = F.cross_entropy(logits_s.reshape(-1, VOCAB), y.reshape(-1))
        serial.zero_grad()
        loss_s.backward()
        xp, yp, want, pos = x[rows], y[rows], logits_s[rows], None
        if c > 1:
            pos = positions(t, c, r)
            xp, yp, want = (split_sequence(v, c, r) for v in (xp, yp, want))
        logits_p = par(xp, pos=pos)
        loss_p = tensor.cross_entropy(logits_p, yp, par.lm_head)
        par.zero_grad()
        loss_p.backward()
        rel(_vocab(logits_p, grid), want, "logits")
        mean = loss_p.detach().clone()
        for axis in ("z", "data", "context"):
            comm.all_reduce(mean, grid, axis, op="avg")
        rel(mean, loss_s.detach(), "loss")
        ref = dict(serial.named_parameters(remove_duplicate=False))
        for name, g in _full_grads(par, grid).items():
            rel(g, ref[name].grad, name)
        with torch.no_grad():
            for p in [*serial.parameters(), *par.parameters()]:
                p.sub_(0.5 * p.grad)
    state = tensor.full_state_dict(par, grid)
    for k, v in serial.state_dict().items():
        rel(state[k], v, "final " + k)
    return worst


def _fake_grid(**sizes) -> ProcessGrid:
    """Sizes only (plan_styles and a Linear's checks read nothing else)."""
    s = {"x": 1, "y": 1, "z": 1, "data": 1, **sizes}
    cpu = torch.device("cpu")
    return ProcessGrid(**s, global_rank=0, backend="gloo", device=cpu, ranks_per_node=8,
                       timeout=None, groups={})  # fmt: skip


def _vocab(logits: torch.Tensor, grid) -> torch.Tensor:
    p = grid.size("x")
    return comm.all_gather(logits.detach(), grid, "x", dim=-1, sizes=chunk_sizes(VOCAB, p))


# ---------------------------------------------------------------------------- the bytes
B, T, H, L = 2, 8, 16, 2  # batch, sequence, width, layers: every size divides over 2 and 4


def _bytes(grid, plan) -> dict:
    """One forward and backward of a GPT on ``grid``: the x axis's bytes by kind."""
    cfg = GPTConfig(vocab_size=36, block_size=T, n_layer=L, n_head=4, n_embd=H)
    torch.manual_seed(0)
    model = tensor.parallelize(GPT(cfg).to(F64), grid, plan)
    ids = torch.randint(0, 36, (B, T + 1), generator=torch.Generator().manual_seed(1))
    with comm.record(grid) as traffic:
        loss = tensor.cross_entropy(model(ids[:, :-1]), ids[:, 1:], model.lm_head)
        loss.backward()
    return traffic.as_dict().get("x", {})


def expected_bytes(p: int) -> tuple[dict, dict]:
    """(plain, sequence-parallel) bytes per rank over x of :func:`_bytes`'s step, written out.

    V = B·T·H·8 bytes is the residual stream of a rank (float64). Plain: each of the 2L
    chains all-reduces V forward and backward, the head (vocabulary over x) its input's
    gradient, the tied token embedding (ids over x) its rows, the position embedding
    (features over x) all-gathers T·H·8, and the loss two all-reduces of 1 and 2 numbers per
    token. Sequence-parallel: each of those all-reduces of V is an all-gather plus a
    reduce-scatter; the position embedding two all-to-alls of its (p−1)/p² share; the
    2L + 1 layer norms all-reduce their weight and bias gradients (2H·8) in backward."""
    ar = lambda n: round(2 * (p - 1) / p * n)  # noqa: E731
    ag = lambda n: round((p - 1) / p * n)  # noqa: E731
    v, loss = B * T * H * 8, ar(B * T * 8) + ar(2 * B * T * 8)
    plain = {"all_reduce": (4 * L + 2) * ar(v) + loss, "all_gather": ag(T * H * 8)}
    seq = {
        "all_gather": (4 * L + 2) * ag(v),
        "reduce_scatter": (4 * L + 2) * ag(v),
        "all_to_all": 2 * (p - 1) * (T // p) * (H // p) * 8,
        "all_reduce": loss + (2 * L + 1) * ar(2 * H * 8),
    }
    return plain, seq


# ---------------------------------------------------------------------- activation memory
MEM = {"vocab_size": 64, "block_size": 32, "n_layer": 4, "n_head": 4, "n_embd": 64}
MEM_ROWS = 4  # sequences per rank


def _saved_and_predicted(grid) -> tuple[int, float]:
    """Bytes autograd saved on this rank for one step of a float32 GPT with sequence
    parallelism (distinct storages, parameters left out), and the planner's activations."""
    from gnnpar.models.gpt.cost import GPTProblem
    from gnnpar.models.gpt.memory import gpt_memory

    torch.manual_seed(0)
    model = tensor.parallelize(GPT(GPTConfig(**MEM)), grid, SP)
    ids = torch.randint(0, 64, (MEM_ROWS, 33), generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = tensor.cross_entropy(model(ids[:, :-1]), ids[:, 1:], model.lm_head)
    loss.backward()
    problem = GPTProblem(GPTConfig(**MEM), batch=MEM_ROWS * grid.size("data"), element_size=4)
    predicted = gpt_memory(problem, grid.shape, sequence_parallel=True)["activations"]
    return sum(seen.values()), predicted


# ------------------------------------------------------------------------------ the worlds
def _dropout_masks(grid) -> dict:
    """Dropout on shards: the masks of the two x ranks differ, the global generator agrees."""
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=4, n_embd=20, dropout=0.5)
    model = tensor.parallelize(GPT(cfg), grid, SP)
    masks = []
    model.drop.register_forward_hook(lambda m, a, out: masks.append(out.detach() == 0))
    model(torch.zeros(2, 16, dtype=torch.long))
    mine = masks[0].to(F64)
    both = comm.all_gather(mine, grid, "x", dim=1)  # (2, 16, 20): ranks' tokens 0-7, 8-15
    after = torch.rand(4, dtype=F64)
    return {
        "same masks": bool(torch.equal(both[:, :8], both[:, 8:])),
        "dropped": float(mine.mean()),
        "generators agree": bool(torch.equal(comm.all_gather(after, grid, "x"), after.repeat(2))),
    }


def _world2() -> dict:
    out = {}
    grid = gnnpar.init(x=2)
    out["gpt x=2"] = _compare(_gpt, grid)
    out["llama x=2"] = _compare(_llama, grid)
    out["gpt x=2 full recompute"] = _compare(_gpt, grid, checkpointing="full")
    out["llama x=2 selective recompute"] = _compare(_llama, grid, checkpointing="selective")
    out["gpt x=2 1 token"] = _compare(_gpt, grid, t=1)  # rank 1 holds none
    out["bytes"] = {"plain": _bytes(grid, None), "sp": _bytes(grid, SP)}
    out["dropout"] = _dropout_masks(grid)
    out["memory x=2"] = _saved_and_predicted(grid)
    try:
        tensor.parallelize(_llama(n_kv_head=1), grid, SP)
    except UserError as err:
        out["unsplit heads"] = str(err)
    gnnpar.release(grid)
    grid = gnnpar.init(data=2)
    out["memory x=1"] = _saved_and_predicted(grid)
    gnnpar.release(grid)
    return out


def _world4() -> dict:
    out = {}
    shapes = (dict(x=4), dict(data=2, x=2), dict(context=2, x=2), dict(x=2, y=2), dict(x=2, z=2))
    for shape in shapes:
        grid = gnnpar.init(**shape)
        name = ",".join(f"{k}={v}" for k, v in shape.items())
        t = 8 if "context" in shape else 9  # context: two equal chunks per rank
        out[f"gpt {name}"] = _compare(_gpt, grid, t=t)
        kv = 4 if shape.get("x") == 4 else 2
        if "y" not in shape and "z" not in shape:  # y and z: our GPT only (time)
            out[f"llama {name}"] = _compare(lambda kv=kv: _llama(kv), grid, t=t)
        if shape == dict(x=4):
            out["gpt x=4 3 tokens"] = _compare(_gpt, grid, t=3)  # rank 3 holds none
            out["bytes"] = {"plain": _bytes(grid, None), "sp": _bytes(grid, SP)}
            out["memory x=4"] = _saved_and_predicted(grid)
        gnnpar.release(grid)
    return out


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, 2, timeout=300)[0]


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_world4, 4, timeout=300)[0]


EQUAL2 = ["gpt x=2", "llama x=2", "gpt x=2 full recompute", "llama x=2 selective recompute",
          "gpt x=2 1 token"]  # fmt: skip
EQUAL4 = [f"{m} {g}" for g in ("x=4", "data=2,x=2", "context=2,x=2") for m in ("gpt", "llama")]
EQUAL4 += ["gpt x=2,y=2", "gpt x=2,z=2", "gpt x=4 3 tokens"]


@pytest.mark.parametrize("case", EQUAL2)
def test_equals_serial_on_2_ranks(world2, case):
    worst = max(world2[case].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-12, worst


@pytest.mark.parametrize("case", EQUAL4)
def test_equals_serial_on_4_ranks(world4, case):
    worst = max(world4[case].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-12, worst


@pytest.mark.parametrize("p", [2, 4])
def test_bytes_are_plain_tensor_parallelisms(world2, world4, p):
    got = (world2 if p == 2 else world4)["bytes"]
    plain, seq = expected_bytes(p)
    assert got["plain"] == plain
    assert got["sp"] == seq
    # each chain's all-reduce (and the head's, the tied embedding's) is a gather + a scatter
    loss_and_norms = seq["all_reduce"]
    assert seq["all_gather"] + seq["reduce_scatter"] == plain["all_reduce"] - (
        loss_and_norms - (2 * L + 1) * round(2 * (p - 1) / p * 2 * H * 8)
    )


def test_activation_memory_falls_with_x_as_the_planner_predicts(world2, world4):
    rows = []
    for key, world in (("memory x=1", world2), ("memory x=2", world2), ("memory x=4", world4)):
        saved, predicted = world[key]
        rows.append((key, saved, predicted))
        assert 0.8 <= saved / predicted <= 1.2, (key, saved, predicted)
    saved = [r[1] for r in rows]
    assert saved[0] > saved[1] > saved[2]  # 1/x of the norms, dropouts and residual stream


def test_dropout_draws_other_masks_on_each_shard(world2):
    got = world2["dropout"]
    assert not got["same masks"] and 0.4 < got["dropped"] < 0.6 and got["generators agree"]


def test_what_cannot_work_is_refused_in_one_line(world2):
    assert world2["unsplit heads"] == (
        "attention block 'blocks.0.attn': n_kv_head=1 does not divide over x=2; sequence "
        "parallelism needs its heads split over x: choose an x that divides them"
    )
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.config import ConfigError

    grid = _fake_grid(x=2)
    with pytest.raises(UserError, match="Plan.decompose needs Plan.sequence_parallel"):
        tensor.plan_styles(_gpt(), grid, tensor.Plan(decompose=True))

    class Outside(torch.nn.Module):  # a Linear of its own on the residual stream
        def __init__(self):
            super().__init__()
            self.gpt, self.extra = _gpt(), torch.nn.Linear(20, 20)

    with pytest.raises(UserError, match="'extra' is a Linear outside the chains"):
        tensor.plan_styles(Outside(), grid, SP)
    tensor.plan_styles(Outside(), grid, tensor.Plan(sequence_parallel=True, skip=("extra",)))
    hf = type("GPT2Block", (torch.nn.Module,), {"__module__": "transformers.models.gpt2"})
    with pytest.raises(UserError, match="transformers' GPT2Block, which reshapes"):
        tensor.plan_styles(torch.nn.Sequential(hf()), grid, SP)
    for bad, match in (
        (dict(tp_overlap="decompose"), "'tp_overlap' \\(decompose\\) needs sequence_parallel"),
        (dict(tp_overlap="ring"), "'tp_overlap' must be one of none, decompose"),
        (dict(sequence_parallel=True, model="hf-gpt2"), "needs model = gpt or llama"),
        (dict(sequence_parallel=True, grid="pipe=2,x=2"), "needs no pipe axis"),
    ):
        with pytest.raises(ConfigError, match=match):
            GPTTaskConfig(**bad).check()
    with pytest.raises(UserError, match="sequence='gather' needs x as the out axis"):
        tensor.Linear(8, 8, grid, sequence="gather")  # transpose=False: out axis y


# ------------------------------------------------------------------------------ the trainer
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind.\n" * 300


def _argv(out: Path, steps: int, *extra: str) -> list[str]:
    text = out.parent / "text.txt"
    return ["train", "gpt", "--data", str(text), "--steps", str(steps), "--n-layer", "2",
            "--n-embd", "16", "--n-head", "2", "--batch-size", "4", "--block-size", "8",
            "--vocab-size", "300",
            "--warmup", "2", "--eval-every", "100", "--val-batches", "1", "--sample-tokens",
            "2", "--dtype", "float64", "--grid", "data=2,x=2", "--zero-stage", "3",
            "--nprocs", "4", "--out", str(out), "--quiet", *extra]  # fmt: skip


def test_trainer_with_sequence_parallel_and_decompose_follows_the_plain_run(tmp_path, monkeypatch):
    from gnnpar.train.metrics import read_metrics
    from tests.cli_world import run_commands
    from tests.test_checkpoint_train import _same

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "text.txt").write_text(TEXT)
    # what every rank would import on its own, imported once here for the forked ranks: the
    # command line's every task (torch_geometric, transformers), torch._dynamo (AdamW's step)
    from gnnpar.cli.top import build_parser

    build_parser()
    warm = torch.zeros(1, requires_grad=True)
    warm.grad = torch.zeros(1)
    torch.optim.AdamW([warm]).step()
    sp = ("--sequence-parallel", "--tp-overlap", "decompose")
    plain, saved, resumed = tmp_path / "plain", tmp_path / "saved", tmp_path / "resumed"
    codes = run_commands(4, [
        _argv(plain, 3),
        _argv(saved, 2, *sp),
        ("copy", saved, resumed),
        _argv(resumed, 3, *sp, "--resume"),
    ])  # fmt: skip
    assert codes == [[0, 0, 0]] * 4

    def losses(run: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}

    want, got = losses(plain), losses(resumed)
    assert sorted(want) == sorted(got) and len(want) == 3
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-12 * abs(loss), (step, got[step], loss)
    assert _same(resumed, plain) <= 1e-12
