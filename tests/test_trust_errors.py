"""One clean error per failure: bad values, the checks before launch, non-finite losses,
failed ranks and OS errors, each through the real ``gnnpar`` command."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from gnnpar.cli import main
from gnnpar.errors import UserError
from gnnpar.train.loop import BaseTask
from tests.conftest import CITESEER, DATASETS, needs_dataset

ROOT = Path(__file__).resolve().parents[1]
#: What must never reach the user of a failed run.
NOISE = ("Traceback", "ChildFailedError", "terminate called")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _no_launch(monkeypatch) -> None:
    """Any attempt to start ranks fails the test: the error must come before."""

    def launch(*a, **k):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr("gnnpar.launch.launch_local", launch)


# --------------------------------------------------------------------------- bad values
def test_bad_values_are_one_line_before_anything_runs(one_process, tmp_path, capsys):
    run = tmp_path / "run"
    cases = [
        (["train", "gcn", "--lr", "inf"], "config key 'lr' must be a finite number, got inf"),
        (["train", "sage", "--weight-decay", "nan"], "config key 'weight_decay' must be a finite"),
        (["train", "gpt", "--beta2", "1.5"], "config key 'beta2' must be in [0, 1), got 1.5"),
        (["train", "gcn", "--weight-decay", "-1"], "config key 'weight_decay' must be >= 0"),
        (["train", "gcn", "--nprocs", "0"], "--nprocs must be at least 1, got 0"),
        (["train", "sage", "--nprocs", "-1"], "--nprocs must be at least 1, got -1"),
        (["info", "--check", "--nprocs", "0"], "--nprocs must be at least 1, got 0"),
        (
            ["train", "gcn", "--dataset-options", "num_nodes=abc"],
            "config key 'dataset_options': option num_nodes: expected int, got 'abc'",
        ),
    ]
    for argv, message in cases:
        assert main([*argv, "--out", str(run)] if argv[0] == "train" else argv) == 2, argv
        assert message in _one_line(capsys), argv
    toml = tmp_path / "c.toml"
    toml.write_text("lr = inf\n")
    assert main(["train", "gpt", "--config", str(toml), "--out", str(run)]) == 2
    line = _one_line(capsys)
    assert f"config file {toml}" in line and "'lr' must be a finite number" in line
    assert not run.exists()  # nothing ran


@needs_dataset(CITESEER)
def test_data_root_has_one_spelling(one_process, capsys):
    assert main(["data", "info", "citeseer", "--root", str(DATASETS)]) == 0
    assert "nodes       3,327" in capsys.readouterr().out
    given = ["data", "info", "citeseer", "--dataset-options", f"root={DATASETS}"]
    assert main(given) == 2
    assert "(--root DIR), not as root=" in _one_line(capsys)


# ------------------------------------------------------------------- checks before launch
def test_checks_before_launch_start_no_rank(one_process, tmp_path, monkeypatch, capsys):
    _no_launch(monkeypatch)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    two = ["--nprocs", "2", "--out", str(run)]
    assert main(["train", "gcn", *two]) == 2
    assert f"run folder {run} already holds a run" in _one_line(capsys)
    fresh = ["--nprocs", "2", "--out", str(tmp_path / "fresh")]
    assert main(["train", "gcn", *fresh, "--grid", "x=4"]) == 2
    assert "= 4 does not divide the world size 2" in _one_line(capsys)
    assert main(["train", "sage", *fresh, "--parts", "3"]) == 2
    assert "'parts' is 3 but 2 processes run" in _one_line(capsys)
    assert main(["train", "sage", *fresh, "--dataset", str(tmp_path / "nothing")]) == 2
    assert "config key 'dataset': unknown dataset" in _one_line(capsys)
    assert main(["train", "gcn", *fresh, "--dataset-options", "num_nodse=5"]) == 2
    assert "num_nodse" in _one_line(capsys)
    assert not (tmp_path / "fresh").exists()


def test_a_run_folder_that_holds_a_run_is_refused_once_with_both_ways_out(
    one_process, tmp_path, monkeypatch, capsys
):
    from gnnpar.train.loop import run_folder_error

    _no_launch(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "start"}\n')
    argv = ["train", "gcn", "--nprocs", "2", "--out", str(run)]
    assert main(argv) == 2  # refused by the launching process: no rank starts
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert captured.out == ""  # not even "starting 2 ranks ..."
    assert line == (
        f"gnnpar train: error: run folder {run} already holds a run: pass --resume to "
        "continue it, or --overwrite to start again (or another --out)"
    )
    # Under plain torchrun every rank checks the folder; rank 0 alone says so.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(argv[:2] + argv[4:]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(argv[:2] + argv[4:]) == 2
    assert "already holds a run" in _one_line(capsys)
    # The trainer's own check raises it on every rank at once: one of them reports it.
    assert run_folder_error(run).same_on_every_rank


def test_a_tasks_preflight_hook_runs_before_launch(one_process, tmp_path, monkeypatch, capsys):
    import dataclasses

    from gnnpar.models.fullgraph import spec

    _no_launch(monkeypatch)
    seen = []

    def preflight(cfg, world_size):
        seen.append((cfg.dataset, world_size))
        raise UserError(f"dataset {cfg.dataset} does not match partition P")

    monkeypatch.setattr(spec, "SPEC", dataclasses.replace(spec.SPEC, preflight=preflight))
    assert main(["train", "gcn", "--nprocs", "3", "--out", str(tmp_path / "r")]) == 2
    assert seen == [("sbm", 3)]
    assert "dataset sbm does not match partition P" in _one_line(capsys)


def test_foreign_artefacts_and_bad_text_are_refused_before_launch(
    one_process, tmp_path, monkeypatch, capsys
):
    """The tasks' own hooks: a partition or shard folder made from another graph, a graph
    with no training nodes and non-UTF-8 text stop the run before any rank starts."""
    import partitioners
    from gnnpar.data import load
    from gnnpar.data.storage import save_graph
    from gnnpar.models.fullgraph.shards import prepare_shards

    _no_launch(monkeypatch)
    small = load("sbm", root=str(tmp_path / "gen"), num_nodes=120, feat_dim=8, num_val=20,
                 num_test=20)  # fmt: skip
    parts = tmp_path / "parts"
    partitioners.write(small, partitioners.partition(small, 2, method="random"), parts, halo=1)
    shards = prepare_shards(small, tmp_path / "shards", blocks=(1, 1))
    two = ["--nprocs", "2", "--dataset-options", "num_nodes=150"]
    assert main(["train", "sage", *two, "--partitions", str(parts), "--out", str(tmp_path)]) == 2
    assert "partition it again" in _one_line(capsys)
    assert main(["train", "gcn", *two, "--shards", str(shards), "--out", str(tmp_path)]) == 2
    assert f"shard folder {shards} was made from graph" in _one_line(capsys)
    untrained = tmp_path / "untrained"
    small.ndata["train_mask"] = torch.zeros(small.num_nodes, dtype=torch.bool)
    save_graph(small, untrained)
    for task in ("gcn", "sage"):
        out = ["--out", str(tmp_path / f"c-{task}")]
        assert main(["train", task, "--nprocs", "2", "--dataset", str(untrained), *out]) == 2
        assert "no training nodes" in _one_line(capsys)
    text = tmp_path / "bad.txt"
    text.write_bytes(b"plain words, then \xff\xfe")
    argv = ["train", "gpt", "--nprocs", "2", "--data", str(text), "--out", str(tmp_path / "d")]
    assert main(argv) == 2
    assert f"{text}: not UTF-8 text (byte offset 18" in _one_line(capsys)


def test_under_plain_torchrun_an_error_every_rank_raises_is_printed_by_rank_0(
    one_process, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["train", "gcn", "--lr", "nan", "--out", str(tmp_path / "r")]
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 2
    assert "config key 'lr' must be a finite number" in _one_line(capsys)


# ---------------------------------------------------------------- user errors and bugs
def _user_errors():
    """One error of each family the command reports as a user error (one line, exit 2)."""
    from gnnpar.checkpoint.protocol import CheckpointError
    from gnnpar.cli.top import CLIError
    from gnnpar.data.imports import UnsafeFileError
    from gnnpar.data.safe_pickle import UnsafePickleError
    from gnnpar.errors import MissingPackageError
    from gnnpar.grid import GridError
    from gnnpar.launch import LaunchError
    from gnnpar.models.fullgraph.shards import OldShardFolderError, ShardFormatError
    from gnnpar.pipeline.schedule import ScheduleError
    from gnnpar.plan.inputs import PlanError
    from gnnpar.shard.offload import OffloadError
    from gnnpar.train.config import ConfigError, UnknownKeyError
    from gnnpar.train.metrics import UndefinedScoreError
    from gnnpar.verified import FormatError, OlderFormatError, UnsafeContentError
    from partitioners.cli import CliError
    from partitioners.format import PartitionFormatError, PartitionSourceError

    kinds = [
        UserError, CLIError, ConfigError, UnknownKeyError, GridError, LaunchError, FormatError,
        OlderFormatError, UnsafeContentError, ShardFormatError, OldShardFolderError,
        PartitionFormatError, PartitionSourceError, CheckpointError, OffloadError,
        ScheduleError, UndefinedScoreError, UnsafePickleError, UnsafeFileError,
        MissingPackageError, CliError, PlanError,
    ]  # fmt: skip
    errors = [kind(f"{kind.__name__} of what was given") for kind in kinds]
    errors += [
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/given/file"),
        PermissionError(errno.EACCES, "Permission denied", "/given/folder"),
        OSError(errno.ENOSPC, "No space left on device", "/given/disk"),
    ]
    return errors


def _raising(monkeypatch, err: BaseException) -> None:
    """The checks before launch of ``gnnpar train`` raise ``err`` (the first thing they do)."""

    def check(cfg):
        raise err

    monkeypatch.setattr("gnnpar.train.loop.check_dataset_options", check)


@pytest.mark.parametrize("err", _user_errors(), ids=lambda e: type(e).__name__)
def test_a_user_error_of_each_family_is_one_line_exit_2(
    one_process, tmp_path, monkeypatch, capsys, err
):
    _raising(monkeypatch, err)
    assert main(["train", "gcn", "--out", str(tmp_path / "run")]) == 2
    line = _one_line(capsys)
    assert line.startswith(
        "gnnpar train: error: /given/" if isinstance(err, OSError) else "gnnpar train: error: "
    ), line
    assert "Traceback" not in line


@pytest.mark.parametrize(
    "err",
    [ValueError("shapes (3,) and (4,) disagree"), TypeError("bad operand"), KeyError("feat"),
     RuntimeError("a state that cannot happen"), IndexError("index 5 is out of bounds")],
    ids=lambda e: type(e).__name__,
)  # fmt: skip
def test_a_bug_inside_the_library_is_not_a_user_error(
    one_process, tmp_path, monkeypatch, capsys, err
):
    """A plain ValueError (or TypeError, KeyError...) from inside gnnpar or torch is a bug: not
    the one line and exit 2 of a user error, but its traceback (the console script exits 1);
    under a gnnpar launch the rank records it with its traceback for the agent, exit 1."""
    _raising(monkeypatch, err)
    argv = ["train", "gcn", "--out", str(tmp_path / "run")]
    with pytest.raises(type(err)):
        main(argv)
    assert "error:" not in capsys.readouterr().err
    from gnnpar.launch import ERROR_DIR_ENV, read_failures

    folder = tmp_path / "failures"
    folder.mkdir()
    monkeypatch.setenv(ERROR_DIR_ENV, str(folder))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 1
    (record,) = read_failures(folder)
    assert record["code"] == 1 and not record["secondary"], record
    assert record["message"].startswith(f"{type(err).__name__}: ")
    assert "Traceback" in record["detail"] and "check_dataset_options" in record["detail"]


def test_the_console_script_shows_a_bugs_traceback_with_status_1(tmp_path):
    code = (
        "import sys, gnnpar.train.loop as loop\n"
        "def check(cfg): raise ValueError('shapes (3,) and (4,) disagree')\n"
        "loop.check_dataset_options = check\n"
        "from gnnpar.cli import console\n"
        f"sys.argv = ['gnnpar', 'train', 'gcn', '--out', {str(tmp_path / 'run')!r}]\n"
        "sys.exit(console())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "ValueError: shapes (3,) and (4,) disagree" in proc.stderr
    assert "gnnpar train: error:" not in proc.stderr


# --------------------------------------------------------------------- non-finite loss
def test_a_non_finite_loss_stops_the_run_naming_the_step(one_process, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "gcn", "--dataset", "karate", "--epochs", "4", "--lr", "1e30"]
    assert main([*argv, "--quiet", "--eval-every", "0", "--out", str(run)]) == 1
    line = _one_line(capsys)
    assert "gnnpar train: error: loss is nan at epoch 2 of 4" in line
    assert "--skip-nonfinite" in line


class _FlakyTask(BaseTask):
    """One weight; the loss of step ``bad`` is NaN once (and its update garbage)."""

    unit = "step"

    def __init__(self, grid, num_steps: int, bad: set[int]):
        self.grid, self.num_steps, self.bad = grid, num_steps, set(bad)
        self.model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(self.model.weight)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.1)

    def train_step(self, step: int) -> dict[str, float]:
        loss = self.model(torch.ones(1, 1)).sum()
        if step in self.bad:
            self.bad.discard(step)
            loss = loss * float("nan")
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return {"loss": float(loss.detach())}

    def evaluate(self, step: int) -> dict[str, float]:
        return {"weight": float(self.model.weight.detach())}

    def extra_state(self) -> dict:
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    def describe(self) -> dict:
        return {"task": "flaky"}


def test_skip_nonfinite_undoes_bad_steps_and_counts_them(tmp_path):
    import gnnpar
    from gnnpar.train.loop import NonFiniteLossError, Trainer
    from gnnpar.train.metrics import read_metrics

    grid = gnnpar.init()
    clean = Trainer(_FlakyTask(grid, 5, set()), tmp_path / "a", eval_every=0, quiet=True).run()
    task = _FlakyTask(grid, 5, {0, 3})
    trainer = Trainer(task, tmp_path / "b", eval_every=0, quiet=True, skip_nonfinite=2)
    skipped = trainer.run()
    # two steps undone, each retried on nothing: 3 good updates instead of 5
    three = Trainer(_FlakyTask(grid, 3, set()), tmp_path / "c", eval_every=0, quiet=True).run()
    assert skipped == three != clean
    records = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in records if r.get("skipped")] == [1, 4]
    assert records[-1]["skipped_steps"] == 2
    with pytest.raises(
        NonFiniteLossError,
        match=r"loss is nan at step 4 of 5, after 1 skipped steps \(--skip-nonfinite 1\)",
    ):
        Trainer(
            _FlakyTask(grid, 5, {0, 3}), tmp_path / "d", eval_every=0, quiet=True, skip_nonfinite=1
        ).run()


# ----------------------------------------------------------------------- failed ranks
def test_a_user_error_in_one_of_two_ranks_is_one_line_exit_2(tmp_path):
    """A given shard folder of the right graph passes the checks before launch, but one of
    its block files was changed (same size); the rank that maps it finds out, its peer only
    hears that it failed. The user sees one line naming that rank and the file."""
    first = tmp_path / "first"
    base = ["train", "gcn", "--dataset", "karate", "--epochs", "1", "--quiet", "--blocks", "1"]
    assert main([*base, "--out", str(first)]) == 0
    (shards,) = [p for p in (first / "shards").iterdir() if not p.name.startswith(".")]
    block = shards / "adj0" / "r0_c0.values.npy"
    data = bytearray(block.read_bytes())
    data[-4:] = b"\x00\x00\x80\x7f"  # the last weight becomes +inf, same size
    block.write_bytes(bytes(data))
    argv = [*base, "--nprocs", "2", "--grid", "x=2", "--shards", str(shards)]
    argv += ["--out", str(tmp_path / "run")]
    env = {**os.environ, "GNNPAR_DEVICE": "cpu"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "gnnpar.cli", *argv],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("gnnpar train: error: rank "), lines[0]
    assert "r0_c0.values.npy: checksum differs from the manifest" in lines[0]
    assert not any(word in proc.stderr + proc.stdout for word in NOISE)


def test_the_root_cause_comes_before_peers_lost_connections(tmp_path, monkeypatch):
    from gnnpar.launch import read_failures, record_failure, summarise_failure

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    record_failure(tmp_path, 0, "RuntimeError: Connection reset by peer", 1, "tb0", True)
    record_failure(tmp_path, 1, "no ind.citeseer.* files under /x", 2)
    record_failure(tmp_path, 2, "PeerFailedError: rank 0 failed (see its error)", 1, "tb2", True)
    records = read_failures(tmp_path)
    assert [r["rank"] for r in records] == [1, 0, 2]
    assert summarise_failure(None, records, 3) == (
        "rank 1 of 3: no ind.citeseer.* files under /x",
        2,
    )
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a newer attempt wins
    record_failure(tmp_path, 2, "ZeroDivisionError: division by zero", 1, "Traceback ...")
    line, code = summarise_failure(None, read_failures(tmp_path), 3)
    assert code == 1
    assert line.splitlines()[0] == (
        "rank 2 of 3: ZeroDivisionError: division by zero (its traceback follows)"
    )
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # every rank fails alike
    for rank in (2, 0, 1):
        record_failure(tmp_path, rank, "loss is nan at epoch 2 of 3", 1)
    line, _ = summarise_failure(None, read_failures(tmp_path), 3)
    assert line == "rank 0 of 3: loss is nan at epoch 2 of 3"


def _raised(err: BaseException, cause: BaseException | None = None, context=None):
    """``err`` as raised: ``from cause``, or while handling ``context``."""
    try:
        if context is None:
            raise err from cause
        try:
            raise context
        except BaseException:
            raise err  # noqa: B904 - raised while handling ``context``, not from it
    except BaseException as got:
        return got


def test_a_peers_failure_is_told_by_the_errors_type_not_its_text():
    import torch.distributed as dist

    from gnnpar.comm import CommError
    from gnnpar.errors import PeerFailedError
    from gnnpar.launch import is_secondary

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:54468: Connection reset by peer")  # fmt: skip
    secondary = [
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        BrokenPipeError(errno.EPIPE, "Broken pipe"),
        TimeoutError("timed out"),
        PeerFailedError("rank 0 could not prepare the graph shards (see its error)"),
        dist.DistNetworkError("Socket Timeout"),
        dist.DistStoreError("wait timeout"),
        gloo,
        _raised(CommError("all_reduce over grid axis 'x' failed"), cause=gloo),
        _raised(CommError("barrier failed"), cause=dist.DistNetworkError("Connection reset")),
    ]
    for err in secondary:
        assert is_secondary(err), repr(err)
    primary = [
        ValueError("connection closed by peer"),
        UserError("timed out waiting for the data: see its error"),
        RuntimeError("peer index 3 is not another rank of the group of 2"),
        CommError("all_reduce over grid axis 'x': tensor on cpu, the grid's device is cuda:0"),
        dist.DistBackendError("NCCL error: invalid usage"),
        _raised(ValueError("a bug"), context=ConnectionResetError("reset")),
        _raised(UserError("bad file"), cause=ValueError("connection reset")),
    ]
    for err in primary:
        assert not is_secondary(err), repr(err)


# --------------------------------------------------------------------------- OS errors
class _FullDisk:
    """A file opened for appending on a full disk: every write fails."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_one_line_naming_the_file(one_process, tmp_path, monkeypatch, capsys):
    from gnnpar.train import metrics

    def full_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return _FullDisk(f) if "a" in mode else f

    monkeypatch.setattr(metrics, "open", full_open, raising=False)
    run = tmp_path / "run"
    argv = ["train", "gcn", "--dataset", "karate", "--epochs", "1", "--quiet"]
    assert main([*argv, "--out", str(run)]) == 2
    assert _one_line(capsys) == f"gnnpar train: error: {run / 'metrics.jsonl'}: disk full"


def test_atomic_write_names_the_destination_of_a_full_disk(tmp_path, monkeypatch):
    from gnnpar.atomic import atomic_write, os_error_message

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("gnnpar.atomic.os.replace", full)
    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "meta.json", lambda tmp: Path(tmp).write_text("{}"))
    assert os_error_message(info.value) == f"{tmp_path / 'meta.json'}: disk full"
    assert list(tmp_path.iterdir()) == []  # no temporary file left


def test_a_read_only_run_folder_is_one_line_before_launch(
    one_process, tmp_path, monkeypatch, capsys
):
    _no_launch(monkeypatch)
    parent = tmp_path / "ro"
    parent.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: the file system says no instead

        def refuse(*a, dir=None, **k):  # noqa: A002 - tempfile's keyword
            if Path(dir or ".").resolve() == parent.resolve():
                raise PermissionError(errno.EACCES, "Permission denied", str(dir))
            return real(*a, dir=dir, **k)

        real = tempfile.mkstemp
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    else:
        parent.chmod(0o555)
    try:
        for nprocs in ("1", "2"):
            argv = ["train", "gcn", "--nprocs", nprocs, "--out", str(parent / "run")]
            assert main(argv) == 2
            line = _one_line(capsys)
            assert line == f"gnnpar train: error: {parent}: not writable (permission denied)"
    finally:
        parent.chmod(0o755)


# ------------------------------------------------------------------ crafted and damaged files
PLANETOID_DAMAGE = {
    # a file that unpickles (numpy and scipy objects only) but is not what Planetoid holds
    "graph": ({0: [10**7]}, "ind.citeseer.graph names node 10000000"),
    "y": (["a", "b"], "not a consistent Planetoid dataset (ValueError"),
    "test.index": (b"1 2 x\n", "ind.citeseer.test.index: not a list of node ids"),
}


@needs_dataset(CITESEER)
@pytest.mark.parametrize("part", sorted(PLANETOID_DAMAGE))
def test_a_crafted_planetoid_file_is_one_line(tmp_path, capsys, part):
    """A crafted Planetoid file was a traceback in train and gnnpar-partition (an
    IndexError, a ValueError from numpy); now one line naming the file."""
    import pickle
    import shutil

    from partitioners.cli import main as partition_main

    root = tmp_path / "planetoid"
    root.mkdir()
    for path in (DATASETS / CITESEER).parent.glob("ind.citeseer.*"):
        shutil.copy(path, root)
    value, words = PLANETOID_DAMAGE[part]
    target = root / f"ind.citeseer.{part}"
    target.write_bytes(value if isinstance(value, bytes) else pickle.dumps(value))
    capsys.readouterr()
    argv = ["citeseer", "--root", str(tmp_path)]
    assert main(["train", "gcn", "--dataset", *argv, "--out", str(tmp_path / "r")]) == 2
    assert words in _one_line(capsys)
    argv += ["--parts", "2", "--out", str(tmp_path / "p"), "--no-progress"]
    assert partition_main(argv) == 2
    assert words in _one_line(capsys)


def test_a_file_that_is_not_dgl_is_one_line(tmp_path, capsys):
    """A .bin that is not a DGL file printed DGL's 13-line C++ stack."""
    pytest.importorskip("dgl")
    (tmp_path / "g.bin").write_bytes(os.urandom(3000))
    assert main(["data", "import", str(tmp_path / "g.bin"), "--out", str(tmp_path / "g")]) == 2
    assert "g.bin: not a dgl.save_graphs file (no DGL header)" in _one_line(capsys)


def test_a_corrupt_pretrained_safetensors_is_one_line(tmp_path, capsys):
    """A corrupt model.safetensors given to --pretrained was safetensors' traceback."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config

    from gnnpar.data.text import load_corpus

    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    folder = tmp_path / "pretrained"
    folder.mkdir()
    GPT2Config(vocab_size=300, n_positions=16, n_embd=16, n_layer=1, n_head=2).save_pretrained(
        folder
    )
    load_corpus(text, 300).tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "model.safetensors").write_bytes(os.urandom(5000))
    argv = ["train", "gpt", "--model", "hf-gpt2", "--pretrained", str(folder), "--data"]
    argv += [str(text), "--steps", "1", "--block-size", "8", "--quiet"]
    argv += ["--out", str(tmp_path / "r")]
    capsys.readouterr()
    assert main(argv) == 2
    assert f"{folder / 'model.safetensors'}: not a readable safetensors file" in _one_line(capsys)


def test_errors_name_their_file_or_key(tmp_path, capsys):
    """Errors that named neither file nor key (a numpy or torch traceback since user
    errors are typed): a seed no generator takes, an .npz with a string array, a metrics
    file that is not UTF-8."""
    import numpy as np
    import scipy.sparse as sp

    for seed in ("-1", str(10**25)):
        argv = ["train", "gcn", "--dataset", "karate", "--seed", seed]
        assert main([*argv, "--out", str(tmp_path / "r")]) == 2
        assert f"config key 'seed' must lie in [0, 2**63), got {seed}" in _one_line(capsys)
    sp.save_npz(tmp_path / "g.npz", sp.csr_matrix(np.eye(4)))
    arrays = dict(np.load(tmp_path / "g.npz"))
    np.savez(tmp_path / "g.npz", **arrays, label=np.array(list("abcd")))
    assert main(["data", "import", str(tmp_path / "g.npz"), "--out", str(tmp_path / "g")]) == 2
    assert "g.npz: array 'label' holds <U1 values" in _one_line(capsys)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b'{"epoch": 1, "loss": 1.0}\n\xff\xfe\n')
    assert main(["report", str(run)]) == 2
    assert f"{run / 'metrics.jsonl'}: line 2 is not UTF-8 text" in _one_line(capsys)


def test_sizes_are_checked_before_they_are_allocated(tmp_path, capsys, monkeypatch):
    """A two-line edge list naming node 3e9 grew data import to 21 GB until the kernel
    killed it; a huge `# nodes:` line, num_nodes=2**40 in a PyG file and num_nodes=1e13 in
    a generator's options were allocation tracebacks. Each is one line naming the file or
    the options and the bytes, before anything is allocated. The machine is made to have
    8 GiB available, so that the test means the same everywhere."""
    monkeypatch.setattr("gnnpar.allocation.available_bytes", lambda: 8 << 30)
    files = {
        "ids.txt": "0 1\n1 3000000000\n",
        "header.txt": "# nodes: 100000000000000\n0 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        assert main(["data", "import", str(tmp_path / name), "--out", str(tmp_path / "g")]) == 2
        line = _one_line(capsys)
        assert f"{name}: a graph of " in line and "8 GiB is available" in line, line
    pyg = pytest.importorskip("torch_geometric.data")
    edges = torch.tensor([[0, 1], [1, 0]])
    torch.save(pyg.Data(edge_index=edges, num_nodes=2**40), tmp_path / "g.pt")
    assert main(["data", "import", str(tmp_path / "g.pt"), "--out", str(tmp_path / "g")]) == 2
    assert "g.pt: a graph of 1,099,511,627,776 nodes needs at least 16 TiB" in _one_line(capsys)
    argv = ["train", "gcn", "--dataset", "sbm", "--dataset-options", "num_nodes=10000000000000"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert "sbm with num_nodes=10000000000000" in _one_line(capsys)


class _FillingDisk(_FullDisk):
    """A file on a disk that fills up after its first kilobyte (torch's zip writer reports
    a failed write after the first as its own RuntimeError)."""

    written = 0

    def write(self, data):
        self.written += len(data)
        if self.written > 1024:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def test_a_full_disk_while_checkpointing_names_the_file_and_keeps_the_last(
    one_process, tmp_path, monkeypatch, capsys
):
    """A full disk while a checkpoint's tensors were written was torch's "[enforce fail at
    inline_container.cc] unexpected pos" traceback (torch's zip writer swallows the OS
    error): one line naming the file and "disk full" now, and the previous checkpoint is
    still the newest."""
    from gnnpar import checkpoint, verified

    run = tmp_path / "run"
    argv = ["train", "gcn", "--dataset", "karate", "--quiet", "--out", str(run)]
    assert main([*argv, "--epochs", "2"]) == 0

    def full_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return _FillingDisk(f) if "w" in mode and "step-000004" in str(path) else f

    monkeypatch.setattr(verified, "open", full_open, raising=False)
    capsys.readouterr()
    assert main([*argv, "--epochs", "4", "--resume"]) == 2
    line = _one_line(capsys)
    assert line.startswith("gnnpar train: error: ")
    assert line.endswith("rank-00000.pt: disk full (the previous checkpoint is kept)"), line
    assert "step-000004" in line and "inline_container" not in line
    assert checkpoint.complete_steps(run / "checkpoints") == [2]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_torch_save_on_a_full_device_raises_the_os_error():
    """On a real device that is full (Linux's /dev/full: every write is ENOSPC), torch's
    own zip writer raises its "unexpected pos" RuntimeError; gnnpar's raises the OSError."""
    from gnnpar.verified import torch_save

    with pytest.raises(RuntimeError, match="unexpected pos|failed writing"):
        torch.save({"a": torch.zeros(100_000)}, open("/dev/full", "wb"))  # noqa: SIM115
    with pytest.raises(OSError) as info:
        torch_save({"a": torch.zeros(100_000)}, "/dev/full")
    assert info.value.errno == errno.ENOSPC


def test_a_rank_that_said_nothing_is_named_before_its_peers_lost_connections():
    """torchrun's ChildFailedError names one failed rank, and under load it may be a peer
    that only lost its connection to a rank killed without a word: the silent rank is named
    (seen once in a full run: rank 0's "connection reset" was reported for a SIGKILLed
    rank 1)."""
    from gnnpar.launch import summarise_failure

    peer = {"rank": 0, "message": "connection reset", "code": 1, "detail": "", "secondary": True}

    class Failure:
        failures = {0: type("F", (), {"exitcode": 1, "timestamp": 0})()}

    line, code = summarise_failure(Failure(), [peer], 2)
    assert line.startswith("rank 1 of 2 ended without reporting an error") and code == 1
    assert "--resume" in line
