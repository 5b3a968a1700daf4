"""Mixture of experts: the router (capacity, priority, the load-balancing loss) against a
plain loop, the auxiliary loss balancing a skewed router, expert parallelism equal to the
serial model on every grid shape with an expert axis up to 8 ranks, all-to-all bytes against
the formula, and ``gnnpar train gpt --moe-experts`` on expert grids (ZeRO-3, pipe, resume onto
another expert count)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar import comm, tensor
from gnnpar.errors import UserError
from gnnpar.models.gpt.llama import Llama, LlamaConfig
from gnnpar.models.gpt.model import GPT, GPTConfig
from gnnpar.models.gpt.moe import MoE, route, set_aux_loss_scale
from gnnpar.tensor.experts import expert_parallel
from gnnpar.testing import run_distributed
from tests.test_gpt import _full_grads
from tests.test_plan_measured import _Tokens

F64 = torch.float64
VOCAB = 37
AUX = 0.05  # the auxiliary loss's weight in the equality runs (large: its gradient shows)


# ------------------------------------------------------------------------------ the router
def _route_by_loop(logits: torch.Tensor, k: int, factor: float):
    """The routing rule written out token by token (module docstring of moe.py)."""
    b, t, e = logits.shape
    probs = logits.softmax(-1)
    kept: list[tuple[int, int, int, float]] = []  # (expert, priority, token, weight)
    chosen = [0] * e
    aux = 0.0
    for s in range(b):
        w, i = probs[s].topk(k, -1)
        if k > 1:
            w = w / w.sum(-1, keepdim=True)
        cap = math.ceil(factor * t * k / e) if factor > 0 else t * k
        load = [0] * e
        for c in range(k):  # first choices first, then in token order
            for tok in range(t):
                ex = int(i[tok, c])
                chosen[ex] += 1
                if load[ex] < cap:
                    kept.append((ex, s * k * t + c * t + tok, s * t + tok, float(w[tok, c])))
                load[ex] += 1
        frac = torch.tensor([float((i == x).sum()) for x in range(e)], dtype=F64) / (k * t)
        aux += e * float((frac * probs[s].mean(0)).sum()) / b
    kept.sort()
    return kept, chosen, aux


@pytest.mark.parametrize("k,factor", [(1, 1.0), (2, 1.25), (2, 0.5), (3, 0.0)])
def test_routing_keeps_the_first_choices_within_capacity_as_a_plain_loop_does(k, factor):
    logits = torch.randn(3, 7, 5, dtype=F64, generator=torch.Generator().manual_seed(k))
    logits[0, :, 2] += 3.0  # one sequence crowds expert 2: capacity drops some of it
    r = route(logits, k, factor)
    kept, chosen, aux = _route_by_loop(logits, k, factor)
    assert r.token.tolist() == [tok for _, _, tok, _ in kept]
    assert r.weight.tolist() == pytest.approx([w for *_, w in kept], rel=1e-14)
    assert r.counts == [sum(1 for ex, *_ in kept if ex == x) for x in range(5)]
    assert r.chosen == chosen
    assert float(r.aux) == pytest.approx(aux, rel=1e-12)
    if factor and factor < 1:
        assert sum(r.counts) < sum(chosen)  # something was dropped


def test_the_auxiliary_loss_balances_a_skewed_router():
    """Tokens from a skewed distribution send most of their choices to one expert; training
    the router on the auxiliary loss alone spreads them (max/mean load near 1)."""
    torch.manual_seed(0)
    layer = MoE(16, 4, lambda: torch.nn.Linear(16, 16), top_k=1, capacity_factor=0)
    x = torch.randn(8, 32, 16) + 2.0 * torch.randn(16)  # a shared offset: skewed routing
    with torch.no_grad():
        layer.router.weight[0] += 0.2 * x.mean((0, 1))  # expert 0 wins every token at first
    set_aux_loss_scale(layer, 1.0)
    opt = torch.optim.Adam(layer.router.parameters(), lr=0.01)

    def imbalance() -> float:
        counts = torch.tensor(layer.last_routing.chosen, dtype=F64)
        return float(counts.max() / counts.mean())

    layer(x)
    before, aux_before = imbalance(), float(layer.aux_loss)
    for _ in range(100):
        opt.zero_grad()
        layer(x).sum().mul(0).backward()  # only the auxiliary loss's gradient
        opt.step()
    layer(x)
    after, aux_after = imbalance(), float(layer.aux_loss)
    assert before == 4.0 and after < 1.1, (before, after)  # measured 4.0 → 1.03
    assert aux_before > 3.9 and aux_after < 1.05  # 1 is its minimum; measured 3.93 → 1.02


def test_configs_that_cannot_route_are_refused_in_one_line():
    with pytest.raises(UserError, match="moe_top_k=5 must lie in 1..moe_experts=4"):
        GPTConfig(moe_experts=4, moe_top_k=5)
    grid = gnnpar.init()
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=8,
                          moe_experts=3))  # fmt: skip
    expert_parallel(model, grid)  # one rank holds all three
    with pytest.raises(UserError, match="already split"):
        expert_parallel(model, grid)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--moe-experts", "4", "--moe-top-k", "5"], "moe_top_k=5 must lie in 1..moe_experts=4"),
        (["--moe-experts", "3", "--grid", "expert=2"], "must be a multiple of the grid's expert=2"),
        (["--grid", "expert=2"], "an expert axis .expert=2. needs moe_experts > 0"),
        (["--moe-experts", "4", "--grid", "context=2"], "needs no context axis"),
        (["--moe-experts", "4", "--model", "hf-gpt2"], "needs model = gpt or llama"),
    ],
)
def test_trainer_refuses_moe_options_that_cannot_work_in_one_line(extra, message, capsys):
    from gnnpar.cli import main

    assert main(["train", "gpt", "--nprocs", "2", "--steps", "1", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


# ------------------------------------------------------------------- expert parallelism
def _tiny(kind: str = "gpt", **kw):
    sizes = {"vocab_size": VOCAB, "block_size": 8, "n_layer": 2, "n_head": 4, "n_embd": 16,
             "moe_experts": 4, "moe_top_k": 2, "moe_capacity": 1.0, **kw}  # fmt: skip
    torch.manual_seed(0)
    if kind == "llama":
        return Llama(LlamaConfig(n_kv_head=2, ffn_hidden=22, **sizes)).to(F64)
    return GPT(GPTConfig(**sizes)).to(F64)


def _share(grid) -> tuple[int, int]:
    """This rank's share of the batch: split over data, expert and z."""
    index = grid.rank("z") + grid.size("z") * (
        grid.rank("expert") + grid.size("expert") * grid.rank("data")
    )
    return index, grid.size("z") * grid.size("expert") * grid.size("data")


def _compare_moe(make, grid, steps: int = 2) -> float:
    """Serial and expert-parallel copies of ``make()`` for ``steps`` AdamW steps with
    clipping (auxiliary loss on): the largest difference of losses, norms, gradients and
    weights."""
    from gnnpar.shard import shard

    serial = make()
    par = make()
    expert_parallel(par, grid)
    tensor.parallelize(par, grid)
    dp = shard(par, grid, stage=0)
    for m in (serial, par):
        set_aux_loss_scale(m, AUX)
    s, n = _share(grid)
    ids = torch.randint(0, VOCAB, (steps, 8, 9), generator=torch.Generator().manual_seed(5))
    rows = slice(s * 8 // n, (s + 1) * 8 // n)
    opt_s = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-2)
    worst = 0.0
    for step in range(steps):
        x, y = ids[step, :, :-1], ids[step, :, 1:]
        loss_s = F.cross_entropy(serial(x).reshape(-1, VOCAB), y.reshape(-1))
        opt_s.zero_grad()
        loss_s.backward()
        norm_s = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.5)
        loss_p = tensor.cross_entropy(par(x[rows]), y[rows], par.lm_head)
        opt_p.zero_grad()
        loss_p.backward()
        norm_p = dp.clip_grad_norm_(0.5)
        mean = loss_p.detach().clone()
        for axis in ("z", "expert", "data"):
            comm.all_reduce(mean, grid, axis, op="avg")
        worst = max(worst, abs(float(mean) - loss_s.item()), abs(float(norm_p) - float(norm_s)))
        ref = dict(serial.named_parameters(remove_duplicate=False))
        grads = _full_grads(par, grid)
        if not any(".experts." in k for k in grads):
            raise AssertionError("no expert on this rank")
        for name, g in grads.items():
            worst = max(worst, float((g - ref[name].grad).abs().max()))
        opt_s.step()
        opt_p.step()
    ref = serial.state_dict()
    for name, p in par.named_parameters():
        sharded = tensor.sharded_parameters(par)
        if name in sharded:
            m, pname, lay = sharded[name]
            p = m.to_full_format(pname, tensor.gather_full(p.detach(), lay, grid))
        worst = max(worst, float((p.detach() - ref[name]).abs().max()))
    return worst


SHAPES = [
    ({"expert": 2}, "gpt"),
    ({"expert": 4}, "llama"),
    ({"expert": 8}, "gpt"),  # eight experts: one per rank
    ({"expert": 2, "data": 4}, "llama"),
    ({"expert": 4, "data": 2}, "gpt"),
    ({"expert": 2, "x": 2, "data": 2}, "gpt"),
    ({"expert": 2, "x": 2, "y": 2}, "llama"),
    ({"expert": 2, "z": 2, "data": 2}, "gpt"),
    ({"expert": 4, "y": 2}, "gpt"),
]


def _all_to_all_bytes_match_the_formula(grid) -> None:
    """One forward and backward of a Llama on ``grid``: the bytes sent over ``expert`` by
    all-to-all equal, on every rank, the module docstring's formula from the rows each layer
    sent and received."""
    from gnnpar.models.gpt.moe import moe_layers

    model = _tiny("llama")
    expert_parallel(model, grid)
    tensor.parallelize(model, grid)
    ids = torch.randint(
        0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(grid.rank("expert"))
    )
    with comm.record(grid) as traffic:
        model(ids).sum().backward()
    p, e, d = grid.size("expert"), 8, 16  # float64 rows of n_embd
    me = grid.rank("expert")
    want = 0
    for layer in moe_layers(model):
        sent, got = layer.dispatch.last_sent, layer.dispatch.last_received
        others = sum(s for j, s in enumerate(sent) if j != me) + sum(
            q for j, q in enumerate(got) if j != me
        )
        # counts (8-byte integers, E/P per peer) + dispatch and combine, forward and backward
        want += 8 * (p - 1) * (layer.num_experts // p) + 2 * others * d * e
    measured = traffic.bytes("expert", "all_to_all")
    if measured != want or not want:
        raise AssertionError(f"all-to-all over expert: {measured} bytes, formula {want}")


def _routed(model, grid) -> list:
    """What each MoE layer of ``model`` routed in its last forward on this rank."""
    from gnnpar.models.gpt.cost import Routed
    from gnnpar.models.gpt.moe import moe_layers

    out = []
    me = grid.rank("expert")
    for layer in moe_layers(model):
        d = layer.dispatch
        if grid.size("expert") == 1:
            out.append(Routed(tuple(layer.last_routing.counts), 0, 0))
            continue
        others = [j for j in range(grid.size("expert")) if j != me]
        sent = sum(d.last_sent[j] for j in others)
        out.append(Routed(tuple(d.last_rows), sent, sum(d.last_received[j] for j in others)))
    return out


def _planner_bytes_equal_measured(shape: dict, stage: int, recompute: str) -> None:
    """One ``gpt`` task step with a mixture of experts: the bytes :mod:`gnnpar.comm` counts,
    per axis and kind, equal the planner's (:func:`gpt_collectives`) given what was routed."""
    from gnnpar.models.gpt.cost import GPTProblem, gpt_collectives
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.plan.comm_model import bytes_by_axis_kind
    from gnnpar.train.spec import build_task

    sizes = {"vocab_size": VOCAB, "block_size": 9, "n_layer": 2, "n_embd": 24, "n_head": 4,
             "moe_experts": 4, "moe_top_k": 2, "moe_capacity": 1.0}  # fmt: skip
    cfg = GPTTaskConfig(
        **sizes, batch_size=8, grid=",".join(f"{a}={v}" for a, v in shape.items()),
        zero_stage=stage, warmup=1, steps=2, sample_tokens=0, activation_checkpointing=recompute,
    )  # fmt: skip
    task = build_task("gpt", cfg, corpus=_Tokens())
    with comm.record(task.grid) as traffic:
        task.train_step(0)
    problem = GPTProblem(
        GPTConfig(**sizes), batch=8, element_size=4, stage=stage,
        activation_checkpointing=recompute,
    )  # fmt: skip
    routed = _routed(task.net, task.grid)
    predicted = bytes_by_axis_kind(
        gpt_collectives(problem, task.grid.shape, task.grid.coords(), routed=routed)
    )
    if traffic.as_dict() != predicted:
        raise AssertionError(f"{shape} stage {stage}: measured {traffic.as_dict()} != {predicted}")
    gnnpar.grid.release(task.grid)


def _expert_world() -> str:
    import os

    world = int(os.environ["WORLD_SIZE"])
    if world == 4:
        grid = gnnpar.init(expert=4)
        _all_to_all_bytes_match_the_formula(grid)
        gnnpar.grid.release(grid)
        for shape, stage, recompute in (
            ({"expert": 2, "data": 2}, 0, "none"),
            ({"expert": 2, "data": 2}, 3, "full"),
            ({"expert": 2, "x": 2}, 0, "none"),
            ({"expert": 4}, 1, "none"),
        ):
            _planner_bytes_equal_measured(shape, stage, recompute)
    for shape, kind in SHAPES:
        size = math.prod(shape.values())
        if size != world:
            continue
        grid = gnnpar.init(**shape)
        experts = 8 if shape.get("expert") == 8 else 4
        worst = _compare_moe(lambda kind=kind, e=experts: _tiny(kind, moe_experts=e), grid)
        if worst > 1e-12:
            raise AssertionError(f"{grid.describe()} {kind}: differs from serial by {worst}")
        gnnpar.grid.release(grid)
    return "ok"


def test_expert_parallel_equals_serial_on_every_expert_grid_up_to_8_ranks():
    assert run_distributed(_expert_world, 2, timeout=300) == ["ok"] * 2
    assert run_distributed(_expert_world, 4, timeout=300) == ["ok"] * 4
    assert run_distributed(_expert_world, 8, timeout=500) == ["ok"] * 8


# --------------------------------------------------------------------- the trainer
_WORDS = "to be or not that is the question whether tis nobler in mind suffer".split()
TEXT = " ".join(_WORDS[(i * 7 + i // 13) % len(_WORDS)] for i in range(3000))


def _argv(text: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "gpt", "--data", str(text), "--vocab-size", "300", "--block-size", "8",
            "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--moe-experts", "4",
            "--moe-capacity", "1.0", "--moe-aux-loss", "0.05", "--batch-size", "8",
            "--steps", str(steps), "--eval-every", "3", "--val-batches", "1",
            "--sample-tokens", "0", "--quiet", "--dtype", "float64", "--grad-clip", "0.5",
            "--warmup", "0", "--lr-schedule", "constant", "--out", str(out), *extra]  # fmt: skip


def _losses(run: Path, keys=("loss", "val_loss", "moe_aux")) -> list[float]:
    from gnnpar.train.metrics import read_metrics

    return [r[k] for r in read_metrics(run / "metrics.jsonl") for k in keys if k in r]


def test_trainer_runs_moe_on_expert_grids_as_on_one_rank_and_resumes_on_another(tmp_path):
    """``gnnpar train gpt --moe-experts 4`` on data=2 × expert=2 (ZeRO-3), expert=2 × x=2
    (ZeRO-2, full activation checkpointing) and pipe=2 × expert=2 (1F1B): the losses and the
    auxiliary loss of one rank, float64 to 1e-12; a run saved on data=2 × expert=2 resumes on
    expert=4 (one expert per rank) and ends as a run that never stopped."""
    from gnnpar import checkpoint
    from gnnpar.cli import main
    from tests.cli_world import run_commands

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert main(_argv(text, tmp_path / "one", 3, "--grid", "x=1", "--zero-stage", "0")) == 0
    grids = {
        "zero3": ["--grid", "data=2,expert=2", "--zero-stage", "3"],
        "tp": ["--grid", "expert=2,x=2", "--zero-stage", "2",
               "--activation-checkpointing", "full"],
        "pipe": ["--grid", "pipe=2,expert=2", "--zero-stage", "1", "--grad-accum", "2"],
    }  # fmt: skip
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    runs = [_argv(text, tmp_path / name, 3, *extra) for name, extra in grids.items()]
    runs += [
        _argv(text, saved, 2, *grids["zero3"]),
        ("copy", saved, resumed),
        _argv(text, resumed, 3, "--grid", "expert=4", "--zero-stage", "3", "--resume"),
    ]
    assert run_commands(4, runs) == [[0] * 5] * 4
    want = _losses(tmp_path / "one")
    assert len(want) >= 7 and want[0] > want[4]  # 3 steps (loss, aux) and validations
    for name in ("zero3", "tp"):
        assert _losses(tmp_path / name) == pytest.approx(want, rel=1e-12, abs=0), name
    no_aux = ("loss", "val_loss")  # the pipeline reports no auxiliary loss
    assert _losses(tmp_path / "pipe", no_aux) == pytest.approx(
        _losses(tmp_path / "one", no_aux), rel=1e-12, abs=0
    )
    a, b = checkpoint.consolidate(resumed), checkpoint.consolidate(tmp_path / "zero3")
    assert sorted(a) == sorted(b) and any(".experts.3." in k for k in a)
    for k, v in b.items():  # relative to the tensor's largest entry
        assert float((a[k] - v).abs().max()) <= 1e-12 * float(v.abs().max()), k
