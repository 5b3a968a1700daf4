"""``gnnpar train gpt --compile`` (:mod:`gnnpar.compile`): compiled blocks train as the eager
ones, through the trainer, on one rank (GPT with dropout and selective recompute, Llama) and
on data=2,x=2 with ZeRO-3 (plain and with full recompute; backend aot_eager), float32, within
1e-6 on every loss and every parameter of the final checkpoint; the graph breaks are where
the docs say (at the tensor-parallel layers' calls, none on one rank or with ZeRO-3 alone),
real training compiles no more graphs under recompute, and the collectives move the same
bytes.

Relative differences of a parameter are ``‖a − b‖ / ‖b‖`` over the whole tensor: AdamW
divides each element's step by that element's own gradient scale, so an element whose
gradient is rounding noise (in eager mode too, summed in another order) moves by a
learning-rate-sized step of either sign; over the tensor that is noise, elementwise it is
not (docs/training.md#compiled-blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gnnpar
from gnnpar import checkpoint
from gnnpar.testing import run_distributed
from gnnpar.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-6
#: A tiny model and run: compile time, not the step, is what costs on two cores.
SIZES = ["--vocab-size", "300", "--block-size", "16", "--n-layer", "2", "--n-head", "2",
         "--n-embd", "32", "--batch-size", "4", "--steps", "3", "--warmup", "0",
         "--eval-every", "3", "--val-batches", "1", "--sample-tokens", "0", "--quiet",
         "--no-bias"]  # fmt: skip


def _argv(text: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "gpt", "--data", str(text), *SIZES, "--out", str(out), *extra]


def _losses(run: Path) -> list[float]:
    return [r[k] for r in read_metrics(run / "metrics.jsonl") for k in ("loss", "val_loss")
            if k in r]  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300))


def _check_same(eager: Path, compiled: Path) -> None:
    """Every loss (training and validation) and every parameter of the final checkpoints."""
    want, got = _losses(eager), _losses(compiled)
    assert len(want) == 5 and len(got) == 5, (want, got)  # 3 steps, validation at 3 and end
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst <= TOL, (compiled.name, want, got)
    a, b = checkpoint.consolidate(compiled), checkpoint.consolidate(eager)
    assert list(a) == list(b)
    errs = {k: _rel(a[k], b[k]) for k in b}
    assert max(errs.values()) <= TOL, (compiled.name, sorted(errs.items(), key=lambda kv: -kv[1]))
    # the steps moved the parameters: a check of equal copies would be no check
    assert any(_rel(a[k], b[k]) < _rel(b[k], torch.zeros_like(b[k])) for k in b)


@pytest.mark.parametrize(
    "model, extra",
    [
        # dropout: the compiled blocks draw eager's masks (inductor's fallback_random), also
        # when selective recompute draws the attention core's again in backward
        ("gpt", ["--dropout", "0.1", "--activation-checkpointing", "selective"]),
        ("llama", []),
    ],
)
def test_compiled_training_equals_eager_on_one_rank(one_process, tmp_path, model, extra):
    from gnnpar.cli import main

    common = ["--model", model, "--grid", "data=1", "--zero-stage", "0", *extra]
    stats = torch._dynamo.utils.counters["stats"]
    assert main(_argv(one_process, tmp_path / "eager", *common)) == 0
    before = stats["unique_graphs"]
    assert main(_argv(one_process, tmp_path / "compiled", *common, "--compile")) == 0
    # the blocks were compiled: one graph for training, one without gradients (validation)
    assert stats["unique_graphs"] - before == 2
    _check_same(tmp_path / "eager", tmp_path / "compiled")


def test_compiled_training_equals_eager_with_tensor_parallel_zero3(one_process, tmp_path):
    """data=2,x=2, ZeRO-3: the tensor-parallel layers run eagerly between compiled pieces,
    ZeRO-3's hooks gather each block around its compiled forward (and again for full
    recompute, inside backward).

    Backend aot_eager: the graphs Dynamo and AOT autograd make on this grid (where the hooks,
    the breaks and the saved tensors meet) run with eager kernels. With inductor, 4 ranks
    generating a block's 7 graphs' kernels (forward, backward, without gradients) with an
    empty cache took over 20 minutes on a busy 2-core CI host; inductor is checked on one
    rank above."""
    from tests.cli_world import run_commands

    grid = ["--grid", "data=2,x=2", "--zero-stage", "3"]
    compiled = [*grid, "--compile", "--compile-backend", "aot_eager"]
    runs = {
        "eager": grid,
        "compiled": compiled,
        "compiled-full": [*compiled, "--activation-checkpointing", "full"],
    }
    steps = [_argv(one_process, tmp_path / name, *extra) for name, extra in runs.items()]
    assert run_commands(4, steps, timeout=900) == [[0, 0, 0]] * 4
    for name in ("compiled", "compiled-full"):
        _check_same(tmp_path / "eager", tmp_path / name)


# ---------------------------------------------------------------------- graph breaks
def _model(kind: str, grid, mode: str):
    from gnnpar import tensor
    from gnnpar.models.gpt.llama import Llama, LlamaBlock, LlamaConfig
    from gnnpar.models.gpt.model import GPT, Block, GPTConfig, set_activation_checkpointing

    sizes = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**sizes)) if kind == "gpt" else Llama(LlamaConfig(**sizes))
    model = tensor.parallelize(plain, grid)
    set_activation_checkpointing(model, mode)
    return model, Block if kind == "gpt" else LlamaBlock


def _explained(kind: str, grid, mode: str, stage: int | None) -> tuple[int, list]:
    """Graphs and breaks of block 0's forward, compiled as ``compile_blocks`` does (with the
    parameters of a ZeRO-3 unit gathered)."""
    import contextlib

    from gnnpar.compile import compile_blocks, graph_breaks
    from gnnpar.shard import by_type, shard

    model, block = _model(kind, grid, mode)
    compile_blocks(model, block, backend="eager")
    gathered = contextlib.nullcontext()
    if stage is not None:
        gathered = shard(model, grid, stage, units=by_type(block)).gathered()
    x = torch.randn(2, 16, 32, requires_grad=True)
    args = model.block_args(torch.arange(16), x.dtype)
    with gathered:
        graphs, breaks = graph_breaks(model.blocks[0], x, *args)
    return graphs, [(b.reason, b.where) for b in breaks]


def _trained(grid, mode: str, compiled: bool) -> dict:
    """Two ZeRO-3 steps of the GPT (eager, or its blocks compiled with Dynamo's "eager"
    backend: the same graphs and breaks, no code generated): losses, bytes per axis and
    collective, and what Dynamo compiled."""
    from gnnpar import comm, tensor
    from gnnpar.compile import compile_blocks
    from gnnpar.shard import by_type, shard

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, block = _model("gpt", grid, mode)
    if compiled:
        compile_blocks(model, block, backend="eager")
    dp = shard(model, grid, 3, units=by_type(block))
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-3))
    losses = []
    with comm.record(grid) as traffic:
        for step in range(2):
            g = torch.Generator().manual_seed(step * 10 + grid.rank("data"))
            ids = torch.randint(0, 64, (2, 17), generator=g)
            loss = tensor.cross_entropy(model(ids[:, :-1]), ids[:, 1:], model.lm_head)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    counters = torch._dynamo.utils.counters
    return {
        "losses": losses,
        "bytes": traffic.as_dict(),
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
    }


def _breaks_world() -> dict:
    torch.set_num_threads(1)
    grid = gnnpar.init(data=4)
    out: dict = {"explain": {}, "trained": {}}
    for kind in ("gpt", "llama"):
        for mode in ("none", "selective"):
            out["explain"][(kind, "data=4", mode, None)] = _explained(kind, grid, mode, None)
        out["explain"][(kind, "data=4", "none", 3)] = _explained(kind, grid, "none", 3)
    for mode in ("none", "full", "selective"):
        for compiled in (False, True):
            out["trained"][("data=4", mode, compiled)] = _trained(grid, mode, compiled)
    grid = gnnpar.reshape(grid, data=2, x=2)
    for kind in ("gpt", "llama"):
        out["explain"][(kind, "data=2,x=2", "none", 3)] = _explained(kind, grid, "none", 3)
    for mode in ("none", "full", "selective"):
        for compiled in (False, True):
            out["trained"][("data=2,x=2", mode, compiled)] = _trained(grid, mode, compiled)
    gnnpar.shutdown(grid)
    return out


@pytest.fixture(scope="module")
def breaks():
    return run_distributed(_breaks_world, 4, timeout=600)


def test_graph_breaks_are_at_the_tensor_parallel_layers_only(breaks):
    disabled = "Skip calling `torch.compiler.disable()`d function"
    for rank, res in enumerate(breaks):
        for key, (graphs, found) in res["explain"].items():
            kind, grid = key[0], key[1]
            if grid == "data=4":  # no tensor parallelism: one graph, with ZeRO-3 too
                assert (graphs, found) == (1, []), (rank, key, found)
                continue
            # x=2: at each of the four projections' calls (the block's own frame breaks
            # too where it calls attention and the MLP: 6 breaks, 7 graphs in 3 frames)
            assert graphs == 7 and len(found) == 4, (rank, key, graphs, found)
            model_file = "model.py" if kind == "gpt" else "llama.py"
            for reason, where in found:
                assert reason == disabled and where.startswith(model_file), (rank, key, where)


def test_recompute_compiles_nothing_more_and_the_bytes_stay(breaks):
    """Real ZeRO-3 steps: full recompute calls the compiled blocks again in backward with no
    new graph, selective traces its checkpointed core into the same graphs; the compiled
    run's collectives move the eager run's bytes (they run eagerly, counted in Python) and
    its losses are the eager ones."""
    for rank, res in enumerate(breaks):
        runs = res["trained"]
        for grid, graphs, nbreaks in (("data=4", 1, 0), ("data=2,x=2", 7, 6)):
            for mode in ("none", "full", "selective"):
                eager, compiled = runs[(grid, mode, False)], runs[(grid, mode, True)]
                assert eager["graphs"] == 0
                assert (compiled["graphs"], compiled["breaks"]) == (graphs, nbreaks), (
                    rank, grid, mode, compiled)  # fmt: skip
                assert compiled["bytes"] == eager["bytes"], (rank, grid, mode)
                assert compiled["losses"] == pytest.approx(eager["losses"], rel=TOL, abs=0)


# ------------------------------------------------------------------------ refusals
def test_what_cannot_compile_is_refused_in_one_line():
    from gnnpar.compile import compile_blocks, is_compiled
    from gnnpar.errors import UserError
    from gnnpar.models.gpt.model import GPT, Block, GPTConfig
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.config import ConfigError, from_mapping

    with pytest.raises(ConfigError, match="config key 'compile' needs model = gpt or llama"):
        from_mapping(GPTTaskConfig, {"compile": True, "model": "hf-gpt2"}).check()
    from_mapping(GPTTaskConfig, {"compile": True, "model": "llama"}).check()
    model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=2, n_head=1, n_embd=4))
    with pytest.raises(UserError, match="CausalSelfAttention has no Block block"):
        compile_blocks(model.blocks[0].attn, Block)
    assert compile_blocks(model, Block) == ["blocks.0", "blocks.1"]
    assert is_compiled(model.blocks[1]) and not is_compiled(model)
    with pytest.raises(UserError, match="block blocks.0 is already compiled"):
        compile_blocks(model, Block)
