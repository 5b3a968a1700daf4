"""Nothing a user gave is lost: ``--overwrite`` replaces only a folder the command itself
wrote (recognised by its manifest), never an input, a folder that holds one, or a folder
with anything its manifest does not list (gnnpar.verified.check_output)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gnnpar.cli import main as gnnpar_main
from gnnpar.verified import checksum
from partitioners.cli import main as partition_main

SBM = ["--dataset-options", "num_nodes=120,num_classes=3,num_val=20,num_test=20"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its checksum (what a command must not change)."""
    return {
        p.relative_to(folder).as_posix(): checksum(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A graph folder, a partition of it and an edge list, made once for the module."""
    root = tmp_path_factory.mktemp("made")
    assert gnnpar_main(["data", "prepare", "sbm", "--out", str(root / "graph"), *SBM]) == 0
    argv = [str(root / "graph"), "--parts", "2", "--out", str(root / "part"), "--no-progress"]
    assert partition_main(argv) == 0
    (root / "edges.txt").write_text("0 1\n1 2\n2 0\n")
    return root


@pytest.fixture
def work(made, tmp_path) -> Path:
    """A fresh copy of :func:`made` in which a command may do its worst."""
    for name in ("graph", "part"):
        shutil.copytree(made / name, tmp_path / name)
    shutil.copy(made / "edges.txt", tmp_path)
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    return tmp_path


def run(argv: list[str]) -> int:
    return partition_main(argv[1:]) if argv[0] == "partition" else gnnpar_main(argv)


def refused(capsys, argv: list[str], words: str) -> None:
    """``argv`` exits 2 with one line on stderr that says ``words``."""
    capsys.readouterr()
    assert run(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], lines
    assert words in lines[0], lines[0]


# Each command, with {out} for its --out and the inputs it reads from ``work``.
COMMANDS = {
    "partition": ["partition", "{graph}", "--parts", "2", "--no-progress", "--out", "{out}"],
    "partition-streamed": [
        "partition", "{graph}", "--parts", "2", "--no-progress", "--method", "ldg",
        "--memory-limit", "100MB", "--out", "{out}",
    ],
    "import": ["data", "import", "{edges}", "--out", "{out}"],
    "prepare": ["data", "prepare", "{graph}", "--out", "{out}"],
}  # fmt: skip


def argv_for(command: str, work: Path, out: Path) -> list[str]:
    paths = {"graph": work / "graph", "edges": work / "edges.txt", "out": out}
    return [a.format(**{k: str(v) for k, v in paths.items()}) for a in COMMANDS[command]]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_overwrite_never_replaces_an_input_or_its_folder(capsys, work, command):
    """--out is the input (the graph folder; the edge list's own folder holds it) or a
    folder that holds the input: refused, and not one file under ``work`` changes.
    (On main before this check, the partition replaced the graph folder and the import
    deleted the edge list and the user's notes.)"""
    before = snapshot(work)
    out = work if command == "import" else work / "graph"
    refused(capsys, [*argv_for(command, work, out), "--overwrite"], "input")
    refused(capsys, [*argv_for(command, work, work), "--overwrite"], "input")
    assert snapshot(work) == before


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_overwrite_replaces_only_a_folder_the_command_made(capsys, work, command):
    """A user's folder, a folder of another format and the command's own folder with a
    file its manifest does not list are refused unchanged; the command's own folder, or an
    empty one, is replaced."""
    user = work / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work\n")
    other = work / "part"  # a partition folder: another format than a graph folder
    if command.startswith("partition"):
        other = work / "another-graph"
        shutil.copytree(work / "graph", other)
    before = snapshot(work)
    refused(capsys, [*argv_for(command, work, user), "--overwrite"], "not a folder gnnpar wrote")
    refused(capsys, [*argv_for(command, work, other), "--overwrite"], "not a gnnpar.")
    assert snapshot(work) == before

    own = work / "own"
    assert run(argv_for(command, work, own)) == 0
    listed = snapshot(own)
    (own / "sub").mkdir()
    (own / "sub" / "keep.txt").write_text("not the command's\n")
    refused(capsys, [*argv_for(command, work, own), "--overwrite"], "keep.txt")
    assert (own / "sub" / "keep.txt").read_text() == "not the command's\n"
    (own / "sub" / "keep.txt").unlink()
    assert run([*argv_for(command, work, own), "--overwrite"]) == 0
    # the same files again (a partition's manifest records its time, so not the same bytes)
    assert snapshot(own).keys() == listed.keys() and not (own / "sub").exists()
    (work / "empty").mkdir()
    assert run([*argv_for(command, work, work / "empty"), "--overwrite"]) == 0


def test_check_output_rules(tmp_path, made):
    """The rules in the one home, as a library caller meets them."""
    from gnnpar.verified import OutputError, check_output

    graph = made / "graph"
    with pytest.raises(OutputError, match="is this command's input"):
        check_output(graph, "gnnpar.graph", True, [graph])
    with pytest.raises(OutputError, match="holds this command's input"):
        check_output(made, "gnnpar.graph", True, [graph / "manifest.json"])
    with pytest.raises(OutputError, match="lies inside the input folder"):
        check_output(graph / "parts", "gnnpar.partition", True, [graph])
    with pytest.raises(FileExistsError, match="already exists"):
        check_output(graph, "gnnpar.graph", False)
    check_output(graph, "gnnpar.graph", True)  # its own kind, every file listed
    check_output(tmp_path / "new", "gnnpar.graph", False, [graph])  # inside the root: fine
    link = tmp_path / "link"
    os.symlink(graph, link)
    with pytest.raises(OutputError, match="is not a folder"):
        check_output(link, "gnnpar.graph", True)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "manifest.json").write_text("{not json")
    with pytest.raises(OutputError, match="unreadable"):
        check_output(damaged, "gnnpar.graph", True)


def test_shard_folders_keep_their_graph_folder(made, tmp_path):
    """The library's shard writer streams from a graph folder: never onto it."""
    from gnnpar.data import load
    from gnnpar.models.fullgraph.shards import prepare_shards
    from gnnpar.verified import OutputError

    graph = tmp_path / "graph"
    shutil.copytree(made / "graph", graph)
    before = snapshot(graph)
    with pytest.raises(OutputError, match="is this command's input"):
        prepare_shards(graph, graph, blocks=(1, 1), overwrite=True)
    in_memory = load(str(graph))  # no input on disk to name: the format still refuses
    with pytest.raises(OutputError, match="gnnpar.graph folder, not a gnnpar.shards"):
        prepare_shards(in_memory, graph, blocks=(1, 1), overwrite=True)
    assert snapshot(graph) == before
    shards = prepare_shards(graph, tmp_path / "shards", blocks=(1, 1))
    prepare_shards(graph, shards, blocks=(1, 1), overwrite=True)  # its own: replaced


# ---------------------------------------------------------------------- one run per folder
def test_one_run_per_run_folder_and_the_lock_dies_with_its_holder(tmp_path, capsys):
    """Two runs into one --out at once both finished and left a mixed folder. The second
    is refused in one line naming the holder (in the process, and from the launching
    process of --nprocs 2, before any rank starts); once the holder is SIGKILLed the
    folder is free again."""
    import signal
    import subprocess
    import sys
    import time

    from gnnpar.train.lock import LOCK_FILE

    out = tmp_path / "run"
    data = ["--dataset", "sbm", *SBM, "--root", str(tmp_path / "data"), "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    holder = subprocess.Popen(
        [sys.executable, "-m", "gnnpar.cli", "train", "gcn", *data, "--epochs", "100000",
         "--eval-every", "0", "--out", str(out)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        # the holder has the lock and has started writing its run
        while not (f"pid {holder.pid} " in _read(out / LOCK_FILE) and _read(out / "config.toml")):
            assert holder.poll() is None, holder.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first run never started"
            time.sleep(0.1)
        for extra in ([], ["--nprocs", "2"]):
            argv = ["train", "gcn", *data, "--epochs", "1", "--overwrite", "--out", str(out)]
            refused(capsys, [*argv, *extra], f"is in use by another run (pid {holder.pid} on")
        assert (out / "config.toml").is_file()  # the holder's run, not removed by --overwrite
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
    argv = ["train", "gcn", *data, "--epochs", "1", "--overwrite", "--out", str(out)]
    assert run(argv) == 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_consolidate_never_writes_into_a_checkpoint(tmp_path, capsys):
    """`gnnpar ckpt consolidate RUN OUT --overwrite` with OUT a file of the checkpoint it
    reads replaced that file; an OUT inside any verified folder is refused, unchanged."""
    run = tmp_path / "run"
    argv = ["train", "gcn", "--dataset", "karate", "--epochs", "1", "--quiet", "--out", str(run)]
    assert gnnpar_main(argv) == 0
    (step,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")]
    before = snapshot(run)
    for out in (step / "rank-00000.pt", step / "model.pt"):
        refused(capsys, ["ckpt", "consolidate", str(run), str(out), "--overwrite"], "lies inside")
    assert snapshot(run) == before
    assert gnnpar_main(["ckpt", "consolidate", str(run), str(run / "model.pt")]) == 0
