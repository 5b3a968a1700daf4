"""The ``sage`` task: configuration checks, exact resume, the command line, and CiteSeer
accuracy in one process and on 4 ranks (skipped when the CiteSeer files are absent)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gnnpar.cli import main
from gnnpar.models.minibatch.task import MiniBatchConfig, MiniBatchTask
from gnnpar.testing import run_distributed
from gnnpar.train.config import ConfigError, from_mapping
from gnnpar.train.loop import Trainer
from gnnpar.train.metrics import read_metrics
from gnnpar.train.spec import build_task
from tests.conftest import CITESEER, DATASETS, needs_dataset

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_sage_minibatch.py"
SMALL = "num_nodes=300,feat_dim=8,seed=3"


pytestmark = pytest.mark.usefixtures("one_thread")


def config(out: Path, **kw) -> MiniBatchConfig:
    values = {
        "dataset": "sbm",
        "dataset_options": SMALL,
        "fanouts": "5,3",
        "batch_size": 8,
        "hidden": 16,
        "epochs": 4,
        "out": str(out),
        "quiet": True,
        **kw,
    }
    return from_mapping(MiniBatchConfig, values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"fanouts": ""}, "fan-out list is empty"),
        ({"fanouts": "5,0"}, "fan-out 1 is 0"),
        ({"fanouts": "5,3,2"}, "one fan-out per layer"),
        ({"batch_size": 0}, "batch_size"),
        ({"model": "gin"}, "model"),
        ({"dropout": 1.0}, "dropout"),
        ({"parts": 0}, "parts"),
        ({"feature_cache": -1}, "feature_cache"),
        ({"model": "gat", "hidden": 10, "heads": 4}, "divisible"),
    ],
)
def test_bad_config(tmp_path, values, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, **values)


def test_parts_must_match_processes(tmp_path):
    with pytest.raises(ConfigError, match="each data-parallel rank owns one part"):
        build_task("sage", config(tmp_path, parts=2))


def _params(task: MiniBatchTask) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in task.net.state_dict().items()}


@pytest.mark.parametrize("model", ["sage", "gat"])
def test_resume_is_exact(tmp_path, model):
    """4 epochs in one go == 2 epochs, a checkpoint, and 2 more after --resume (dropout,
    shuffling, sampling and the prefetch thread included)."""
    once = build_task("sage", config(tmp_path / "once", model=model))
    Trainer(once, tmp_path / "once", eval_every=0, quiet=True).run()
    first = build_task("sage", config(tmp_path / "split", model=model, epochs=2))
    Trainer(first, tmp_path / "split", eval_every=0, checkpoint_every=1, quiet=True).run()
    assert first.loader.state_dict()["epoch"] == 2
    second = build_task("sage", config(tmp_path / "split", model=model, resume=True))
    Trainer(second, tmp_path / "split", eval_every=0, resume=True, quiet=True).run()
    a, b = _params(once), _params(second)
    assert all(torch.equal(a[k], b[k]) for k in a)
    fresh = build_task("sage", config(tmp_path / "fresh", model=model, seed=1))
    Trainer(fresh, tmp_path / "fresh", eval_every=0, quiet=True).run()
    assert not all(torch.equal(a[k], v) for k, v in _params(fresh).items())


def test_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "sage", "--dataset", "sbm", "--dataset-options", SMALL, "--out", str(out)]
    argv += ["--epochs", "3", "--fanouts", "4,4", "--batch-size", "16", "--quiet"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "done:" in text and "test_acc=" in text
    records = [r for r in read_metrics(out / "metrics.jsonl") if "epoch" in r]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert all(r["seeds_per_s"] > 0 and "val_acc" in r for r in records)
    assert main(["train", "sage", "--print-config", "--fanouts", "15,10"]) == 0
    assert 'fanouts = "15,10"' in capsys.readouterr().out
    assert main(["train", "sage", "--fanouts", "15,10,5", "--out", str(tmp_path / "x")]) == 2
    assert "one fan-out per layer" in capsys.readouterr().err


def _run_example(argv: list[str]) -> str:
    """Rank body: run the example's main() and return what it printed."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("train_sage_minibatch", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert module.main(argv) == 0
    return text.getvalue()


def test_example_script_on_two_ranks(tmp_path):
    """examples/train_sage_minibatch.py trains on 2 ranks (one part each)."""
    argv = ["--dataset", "sbm", "--epochs", "2", "--fanouts", "4,4", "--hidden", "8"]
    argv += ["--feature-cache", "10", "--parts-dir", str(tmp_path / "parts")]
    out = run_distributed(_run_example, 2, argv, env={"GNNPAR_DATA": str(tmp_path)})
    assert "epoch   2:" in out[0] and "seeds/s" in out[0] and "cache hit rate" in out[0]
    assert out[1] == ""  # only rank 0 prints


def _citeseer(out: str, batch_size: int) -> dict[str, float]:
    cfg = from_mapping(
        MiniBatchConfig,
        {
            "dataset": "citeseer",
            "root": str(DATASETS),
            "dataset_options": "normalize_features=true",
            "fanouts": "10,10",
            "batch_size": batch_size,
            "hidden": 32,
            "epochs": 30,
            "out": out,
            "quiet": True,
            "feature_cache": 64,
        },
    )
    task = build_task("sage", cfg)
    result = Trainer(task, cfg.out, eval_every=0, quiet=True).run()
    if task.distributed:
        result["cache_hit_rate"] = task.fetcher.hit_rate()
    return result


@needs_dataset(CITESEER)
def test_citeseer_one_process(tmp_path):
    result = _citeseer(str(tmp_path / "run"), batch_size=32)
    assert result["test_acc"] >= 0.67, result


@needs_dataset(CITESEER)
def test_citeseer_four_ranks(tmp_path):
    """Four ranks, one METIS part each, 8 seeds per rank and step (a global batch of 32)."""
    results = run_distributed(_citeseer, 4, str(tmp_path / "run"), 8, timeout=600)
    assert results[0]["test_acc"] >= 0.67, results[0]
    assert all(r["test_acc"] == results[0]["test_acc"] for r in results)
    rates = [r["cache_hit_rate"] for r in results]
    assert all(0.0 <= x <= 1.0 for x in rates) and max(rates) > 0.0, rates


class _KernelCalls:
    """Stands in for the module of compiled kernels: records the numba types of every call
    with the phase of the run it came in (``phase`` is set from outside)."""

    def __init__(self, kernels):
        self.kernels, self.phase, self.calls = kernels, "set-up", []

    def __getattr__(self, name):
        import numba

        kernel = getattr(self.kernels, name)

        def call(*args):
            self.calls.append((self.phase, name, tuple(numba.typeof(a) for a in args)))
            return kernel(*args)

        return call


@pytest.mark.parametrize("sampler", ["neighbor", "saint-node"])
def test_the_sampling_kernels_are_prepared_before_the_first_epoch_is_timed(
    tmp_path, monkeypatch, capsys, sampler
):
    """numba compiles a kernel on its first call for the argument types it gets (seconds on
    a machine's first run; a fresh clone's first epoch took ~6 s more than the next). The
    task compiles, or loads from numba's cache, every kernel its epochs call, for the types
    they pass, while it sets up, and says so on one line before the first epoch."""
    pytest.importorskip("numba")
    from gnnpar.sampling import compiled

    calls = _KernelCalls(compiled._kernels())
    monkeypatch.setattr(compiled, "_kernels", lambda: calls)
    warm_up, train_step = compiled.warm_up, MiniBatchTask.train_step

    def phase(name, fn):
        def run(*args, **kwargs):
            calls.phase = name
            try:
                return fn(*args, **kwargs)
            finally:
                calls.phase = "other"

        return run

    monkeypatch.setattr(compiled, "warm_up", phase("warm-up", warm_up))
    monkeypatch.setattr(MiniBatchTask, "train_step", phase("epoch", train_step))
    out = tmp_path / "run"
    argv = ["train", "sage", "--dataset", "sbm", "--dataset-options", SMALL, "--out", str(out)]
    argv += ["--sampler", sampler, "--budget", "50", "--presample", "2", "--epochs", "1"]
    assert main([*argv, "--fanouts", "4,4", "--batch-size", "16", "--quiet"]) == 0
    warmed = {(name, types) for p, name, types in calls.calls if p == "warm-up"}
    in_epoch = {(name, types) for p, name, types in calls.calls if p == "epoch"}
    assert in_epoch, "the epoch ran no compiled kernel"
    assert in_epoch <= warmed, in_epoch - warmed
    lines = capsys.readouterr().out.splitlines()
    stage = [i for i, line in enumerate(lines) if line.startswith("preparing the sampling ")]
    assert len(stage) == 1, lines
    assert re.fullmatch(
        r"preparing the sampling kernels \(numba\) \.\.\. [\d.e-]+ s"
        r"(, compiled \(once: numba caches them for later runs\)|, loaded from numba's cache)?",
        lines[stage[0]],
    ), lines[stage[0]]
    assert stage[0] < next(i for i, line in enumerate(lines) if line.startswith("epoch 1/1"))
