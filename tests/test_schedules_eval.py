"""Learning-rate schedules, best-validation selection and early stopping, and ``gnnpar
evaluate`` / ``gnnpar predict`` on a trained run.

One tiny full-graph run (float64, one process, an evaluation every epoch) is the reference
of most checks: a run preempted mid-schedule and resumed must match it exactly; an
early-stopped run must stop where the reference's validation curve says; ``evaluate`` must
give its final test accuracy in this process and on two ranks with another grid; ``predict``
must give the arg-max of the plain model's logits, computed here from the consolidated best
checkpoint and the dataset, in original node order. The multi-rank commands share one world
of forked ranks (tests/cli_world.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from gnnpar import checkpoint
from gnnpar.cli import main
from gnnpar.models.fullgraph.task import FullGraphConfig, FullGraphTask
from gnnpar.models.gpt.task import GPTTaskConfig
from gnnpar.train.config import ConfigError, from_mapping
from gnnpar.train.loop import BaseTask
from gnnpar.train.metrics import read_metrics
from gnnpar.train.schedule import lr_at
from gnnpar.train.spec import build_task, get
from tests.cli_world import run_commands

EPOCHS = 10
#: The reference's options: its validation accuracy peaks at epoch 3 and never beats it,
#: so the best model is not the last one (checked by the tests that need it).
OPTIONS = {
    "dataset": "sbm", "dataset_options": "num_nodes=90,feat_dim=6", "dtype": "float64",
    "epochs": EPOCHS, "eval_every": 1, "quiet": True, "blocks": 3, "grid": "x=1",
    "lr": 0.2, "lr_schedule": "cosine", "warmup": 2, "min_lr": 0.01, "hidden": 8,
}  # fmt: skip


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _argv(out: Path, **changes) -> list[str]:
    """``gnnpar train gcn`` with :data:`OPTIONS` (and ``changes``) into ``out``."""
    opts = {**OPTIONS, "root": str(out.parent / "data"), "out": str(out), **changes}
    argv = ["train", "gcn"]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def _evaluations(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "epoch" in r and "val_acc" in r]


def _end(run: Path) -> dict:
    end = read_metrics(run / "metrics.jsonl")[-1]
    assert end["event"] == "end"
    return {k: v for k, v in end.items() if k != "time"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The reference run: :data:`OPTIONS`, straight through."""
    run = tmp_path_factory.mktemp("runs") / "straight"
    os.environ.pop("RANK", None)
    assert main(_argv(run)) == 0
    return run


@pytest.fixture(scope="module")
def sage_run(reference) -> Path:
    """A tiny mini-batch run on one process (step schedule, early stopping on)."""
    run = reference.parent / "sage"
    argv = ["train", "sage", "--dataset", "sbm", "--dataset-options", "num_nodes=90,feat_dim=6",
            "--root", str(reference.parent / "data"), "--epochs", "4", "--batch-size", "16",
            "--hidden", "8", "--fanouts", "4,3", "--prefetch", "0", "--quiet", "--out", str(run),
            "--lr-schedule", "step", "--lr-step-every", "2", "--early-stop", "3"]  # fmt: skip
    assert main(argv) == 0
    return run


def _best_of(evaluations: list[dict]) -> dict:
    """The first evaluation of the highest validation accuracy (a later tie is not better)."""
    best = evaluations[0]
    for e in evaluations:
        if e["val_acc"] > best["val_acc"]:
            best = e
    return best


# ------------------------------------------------------------------------- schedules
def _cfg(**kw) -> FullGraphConfig:
    return from_mapping(FullGraphConfig, kw)


def test_schedules_follow_their_formulas():
    # warm-up: L·(s+1)/W; step: L·γ^⌊(s−W)/every⌋; cosine: m + ½(1+cos πp)(L−m)
    step = _cfg(lr=0.1, lr_schedule="step", warmup=2, lr_step_every=3, lr_gamma=0.5)
    want = {0: 0.05, 1: 0.1, 2: 0.1, 4: 0.1, 5: 0.05, 7: 0.05, 8: 0.025, 11: 0.0125}
    assert {s: lr_at(step, s, 12) for s in want} == pytest.approx(want, rel=1e-15)
    cos = _cfg(lr=0.1, lr_schedule="cosine", warmup=2, min_lr=0.01)
    # 8 steps: p = (s − 2)/6 is 0, 1/3, 1/2, 1 (and past the end, 1); cos(π/3) = 1/2
    want = {0: 0.05, 2: 0.1, 4: 0.01 + 0.75 * 0.09, 5: 0.055, 8: 0.01, 20: 0.01}
    assert {s: lr_at(cos, s, 8) for s in want} == pytest.approx(want, rel=1e-15)
    const = _cfg(lr=0.1, warmup=4)
    assert [lr_at(const, s, 12) for s in (0, 3, 4, 11)] == pytest.approx([0.025, 0.1, 0.1, 0.1])
    # gpt keeps its warm-up + cosine by default, through the same code
    gpt = GPTTaskConfig(lr=1e-3, min_lr=1e-4, warmup=20, steps=300)
    assert gpt.lr_schedule == "cosine"
    assert lr_at(gpt, 160, 300) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-12)


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"lr_schedule": "linear"}, "'lr_schedule' must be one of constant, step, cosine"),
        ({"lr_gamma": 0.0}, "'lr_gamma' must be in (0, 1]"),
        ({"lr_step_every": 0}, "'lr_step_every' must be at least 1"),
        ({"warmup": -1}, "'warmup' must be at least 0"),
        ({"early_stop": -1}, "'early_stop' must be at least 0"),
        ({"lr_schedule": "cosine", "lr": 0.01, "min_lr": 0.1}, "must not exceed 'lr'"),
    ],
)
def test_schedule_and_selection_options_are_checked(values, words):
    with pytest.raises(ConfigError, match=None) as err:
        _cfg(**values)
    assert words in str(err.value)


# ------------------------------------------------------------- resume, best, early stop
class _Preempted(FullGraphTask):
    """The gcn task, preempted (SIGTERM, as Slurm's --signal) during one epoch."""

    def __init__(self, *args: object, at: int):
        super().__init__(*args)
        self.at = at

    def train_step(self, step: int) -> dict[str, float]:
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().train_step(step)


def test_resume_mid_schedule_continues_exactly_with_the_best_model(reference, tmp_path):
    import gnnpar
    from gnnpar.train.loop import Trainer

    evaluations = _evaluations(reference)
    best = _best_of(evaluations)
    assert best["epoch"] < 4 < EPOCHS, "the reference's best should come before the preemption"
    run = tmp_path / "resumed"
    cfg = from_mapping(
        FullGraphConfig, {**OPTIONS, "root": str(reference.parent / "data"), "out": str(run)}
    )
    spec = dataclasses.replace(get("gcn"), task=functools.partial(_Preempted, at=3))
    task = build_task(spec, cfg)  # preempted after epoch 4: mid warm-up + cosine
    trainer = Trainer.from_config(task, cfg)
    trainer.run()
    gnnpar.shutdown(task.grid)
    assert trainer.preempted_at == 4
    assert main(_argv(run, resume=True)) == 0
    # the same parameters, learning rates, evaluations, best model and final report
    straight, resumed = checkpoint.consolidate(reference), checkpoint.consolidate(run)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    lrs = [r["lr"] for r in read_metrics(run / "metrics.jsonl") if "lr" in r]
    assert lrs == [r["lr"] for r in read_metrics(reference / "metrics.jsonl") if "lr" in r]
    assert len(lrs) == EPOCHS and lrs[0] < lrs[1] > lrs[-1]  # warm-up, then decay
    assert _end(run) == _end(reference)
    assert _end(run)["best_step"] == best["epoch"]
    assert _end(run)["test_acc"] == best["test_acc"] != evaluations[-1]["test_acc"]
    best_dir = run / "checkpoints" / "best"
    assert checkpoint.complete_steps(best_dir) == [best["epoch"]]


def test_early_stopping_stops_at_the_patience_and_reports_the_best_model(reference, tmp_path):
    patience = 2
    evaluations = _evaluations(reference)
    # where the reference's curve says to stop: `patience` evaluations after the last new best
    best, stale, stop = evaluations[0], 0, None
    for e in evaluations[1:]:
        if e["val_acc"] > best["val_acc"]:
            best, stale = e, 0
        else:
            stale += 1
            if stale == patience:
                stop = e["epoch"]
                break
    assert stop is not None and stop < EPOCHS, "the reference should stop early"
    run = tmp_path / "early"
    assert main(_argv(run, early_stop=patience)) == 0
    records = read_metrics(run / "metrics.jsonl")
    assert max(r.get("epoch", 0) for r in records) == stop
    assert [r for r in records if r.get("event") == "early_stop"][0]["step"] == stop
    end = _end(run)
    assert (end["best_step"], end["test_acc"]) == (best["epoch"], best["test_acc"])
    assert checkpoint.complete_steps(run / "checkpoints") == [stop]
    # resuming a run that early stopping ended trains nothing more
    assert main(_argv(run, early_stop=patience, resume=True)) == 0
    assert max(r.get("epoch", 0) for r in read_metrics(run / "metrics.jsonl")) == stop


# ------------------------------------------------------------------ evaluate, predict
def _plain_predictions(run: Path) -> np.ndarray:
    """The arg-max of the plain GCN's logits on the whole graph, in original node order:
    the consolidated best checkpoint in :class:`~gnnpar.models.fullgraph.model.FullGraphGNN` on Â
    of the
    dataset (no gnnpar parallelism)."""
    from gnnpar.data import load
    from gnnpar.models.fullgraph.model import FullGraphGNN
    from gnnpar.sparse.csr import CSRBlock
    from gnnpar.sparse.kernels import LocalSpMM

    graph = load("sbm", root=run.parent / "data", num_nodes=90, feat_dim=6)
    state = checkpoint.consolidate(run / "checkpoints" / "best")
    model = FullGraphGNN(6, OPTIONS["hidden"], graph.num_classes, 2, 0.0).double()
    model.load_state_dict(state)
    a = graph.gcn_norm()
    n = graph.num_nodes
    adj = LocalSpMM(CSRBlock(a.indptr, a.indices, a.edge_weight.double(), (n, n)))
    model.eval()
    with torch.no_grad():
        return model(adj, graph.feat.double()).argmax(1).numpy()


def _no_optimizer(task):
    raise AssertionError(f"{type(task).__name__} built an optimizer to evaluate or predict")


def test_evaluate_and_predict_on_one_and_two_ranks(
    reference, sage_run, tmp_path, capsys, monkeypatch
):
    # they load a model only: no optimizer is built (torch's first imports torch._dynamo,
    # about a CPU-second of every evaluate and predict command)
    monkeypatch.setattr(BaseTask, "optimizer", property(_no_optimizer))
    end = _end(reference)
    out = tmp_path / "eval-one.json"
    assert main(["evaluate", str(reference), "--json", str(out)]) == 0
    one = json.loads(out.read_text())
    assert (one["value"], one["step"]) == (end["test_acc"], end["best_step"])
    assert main(["evaluate", str(reference), "--checkpoint", "latest", "--split", "val"]) == 0
    last = _evaluations(reference)[-1]
    assert f"val_acc={last['val_acc']:.4f}" in capsys.readouterr().out
    assert main(["predict", str(sage_run), "--out", str(tmp_path / "sage-one")]) == 0
    # on 2 ranks, gcn on another grid and sage on 2 data ranks (2 parts): the checkpoints
    # are resharded on load
    two, pred, sage_two = tmp_path / "eval-two.json", tmp_path / "pred", tmp_path / "sage.json"
    codes = run_commands(2, [
        ["evaluate", str(reference), "--nprocs", "2", "--grid", "x=2", "--json", str(two)],
        ["predict", str(reference), "--nprocs", "2", "--grid", "x=2", "--out", str(pred)],
        ["evaluate", str(sage_run), "--nprocs", "2", "--json", str(sage_two)],
        ["predict", str(sage_run), "--nprocs", "2", "--out", str(tmp_path / "sage-two")],
    ])  # fmt: skip
    assert codes == [[0, 0, 0, 0]] * 2
    assert json.loads(two.read_text())["value"] == end["test_acc"]
    assert json.loads(sage_two.read_text())["value"] == _end(sage_run)["test_acc"]
    got = np.load(pred / "predictions.npy", allow_pickle=False)
    about = json.loads((pred / "predictions.json").read_text())
    assert (about["step"], about["shape"], about["dtype"]) == (end["best_step"], [90], "int64")
    assert np.array_equal(got, _plain_predictions(reference))
    # the accuracy of those predictions on the test nodes is the run's
    from gnnpar.data import load

    graph = load("sbm", root=reference.parent / "data", num_nodes=90, feat_dim=6)
    mask = graph.ndata["test_mask"].numpy().astype(bool)
    labels = graph.label.numpy()
    assert (got[mask] == labels[mask]).mean() == pytest.approx(end["test_acc"])
    # sage: the same class ids from one process and from two parts, in original node order
    sage_one = np.load(tmp_path / "sage-one" / "predictions.npy", allow_pickle=False)
    sage_pred = np.load(tmp_path / "sage-two" / "predictions.npy", allow_pickle=False)
    assert np.array_equal(sage_one, sage_pred)
    assert (sage_one[mask] == labels[mask]).mean() == pytest.approx(_end(sage_run)["test_acc"])


def test_evaluate_and_predict_refuse_a_folder_without_run_or_checkpoint(
    reference, tmp_path, capsys
):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["evaluate", str(empty)]) == 2
    assert f"{empty} holds no run: it has no config.toml" in capsys.readouterr().err
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(reference / "config.toml", partial)
    assert main(["predict", str(partial), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"run folder {partial} holds no best checkpoint (no validation "
                        "accuracy was evaluated): use --checkpoint latest")  # fmt: skip
    assert len(err.splitlines()) == 1
    assert main(["evaluate", str(partial), "--checkpoint", "latest"]) == 2
    assert f"run folder {partial} holds no checkpoint" in capsys.readouterr().err
