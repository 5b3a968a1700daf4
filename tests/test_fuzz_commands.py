"""The command line as a hostile user drives it: random commands over damaged inputs and
awkward output folders. Every case must end in success or in exit 2 with one line naming
the problem, no traceback, and no file outside the command's own output changed (every
input and a sibling file are checksummed before and after)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gnnpar.cli import main as gnnpar_main
from gnnpar.verified import checksum, meta_digest
from partitioners.cli import main as partition_main

FUZZ = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
SBM = ["--dataset-options", "num_nodes=80,num_classes=2,num_val=10,num_test=10,feat_dim=4"]

#: The inputs of the workspace, relative to it (a graph folder, a partition of it, an edge
#: list, a scipy file, a run folder with a checkpoint, and a file that is no one's input).
INPUTS = ("graph", "part", "edges.txt", "g.npz", "run")
SIBLING = "notes.txt"

#: Commands over the workspace: ``{out}`` is the output the case draws, the rest its inputs.
COMMANDS = {
    "import-edges": ["data", "import", "edges.txt", "--out", "{out}"],
    "import-npz": ["data", "import", "g.npz", "--out", "{out}"],
    "prepare": ["data", "prepare", "graph", "--out", "{out}"],
    "info": ["data", "info", "graph"],
    "partition": ["partition", "graph", "--parts", "2", "--out", "{out}", "--no-progress"],
    "partition-streamed": [
        "partition", "graph", "--parts", "2", "--method", "fennel", "--memory-limit", "64MB",
        "--out", "{out}", "--no-progress",
    ],
    "inspect": ["partition", "inspect", "part"],
    "ckpt-info": ["ckpt", "info", "run"],
    "consolidate": ["ckpt", "consolidate", "run", "{out}/model.pt"],
    "report": ["report", "run"],
}  # fmt: skip
#: Where a case may write: a new folder, one of the inputs (or the workspace that holds
#: them all), or the sibling file.
OUTS = ("new", "graph", "part", "run", ".", SIBLING)


def _snapshot(root: Path, skip: Path | None) -> dict[str, str]:
    """Checksums of every file under ``root`` except under ``skip`` (the command's output)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not (skip is not None and path.is_relative_to(skip)):
            out[path.relative_to(root).as_posix()] = checksum(path)
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The workspace, made once for the module; every case works on a copy."""
    import torch

    root = tmp_path_factory.mktemp("workspace")
    with contextlib.redirect_stdout(io.StringIO()):
        assert gnnpar_main(["data", "prepare", "sbm", "--out", str(root / "graph"), *SBM]) == 0
        argv = [str(root / "graph"), "--parts", "2", "--out", str(root / "part"), "--no-progress"]
        assert partition_main(argv) == 0
        train = ["train", "gcn", "--dataset", str(root / "graph"), "--epochs", "2", "--quiet"]
        assert gnnpar_main([*train, "--out", str(root / "run")]) == 0
    (root / "edges.txt").write_text("# nodes: 6\n0 1\n1 2\n2 3\n4 5 0.5\n")
    sp.save_npz(root / "g.npz", sp.random(6, 6, density=0.4, format="csr", random_state=1))
    arrays = dict(np.load(root / "g.npz"))
    np.savez(root / "g.npz", **arrays, feat=np.ones((6, 2), dtype=np.float32))
    (root / SIBLING).write_text("the user's own notes\n")
    del torch
    return root


@st.composite
def cases(draw):
    """A command, an output, --overwrite or not, and one damage to one input file (or
    none): a truncation, a flipped bit, random bytes, or a manifest value changed and the
    manifest resealed (so that only the content checks stand)."""
    command = draw(st.sampled_from(sorted(COMMANDS)))
    out = draw(st.sampled_from(OUTS))
    overwrite = draw(st.booleans())
    kind = draw(st.sampled_from(["none", "truncate", "flip", "bytes", "forge"]))
    target = draw(st.sampled_from(INPUTS))
    pick, where, bit = draw(st.integers(0, 10**6)), draw(st.floats(0, 1, exclude_max=True)), 0
    bit = draw(st.integers(0, 7))
    junk = draw(st.binary(max_size=40))
    value = draw(st.one_of(st.integers(-5, 10**12), st.text(max_size=4), st.none()))
    return command, out, overwrite, (kind, target, pick, where, bit, junk, value)


def _damage(root: Path, kind: str, target: str, pick: int, where: float, bit, junk, value):
    base = root / target
    files = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else [base]
    if kind == "none" or not files:
        return
    if kind == "forge":
        manifests = [p for p in files if p.name == "manifest.json"]
        if not manifests:
            return
        path = manifests[pick % len(manifests)]
        doc = json.loads(path.read_text())
        keys = sorted(doc.get("meta", {}))
        if keys:
            doc["meta"][keys[pick % len(keys)]] = value
            doc["meta_xxh3_64"] = meta_digest(doc["meta"])
            path.write_text(json.dumps(doc))
        return
    path = files[pick % len(files)]
    data = bytearray(path.read_bytes())
    at = int(where * len(data))
    if kind == "truncate":
        del data[at:]
    elif kind == "flip" and data:
        data[at] ^= 1 << bit
    elif kind == "bytes":
        data = bytearray(junk)
    path.write_bytes(bytes(data))


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            if argv[0] == "partition":
                code = partition_main(argv[1:])
            else:
                code = gnnpar_main(argv)
        except SystemExit as stop:
            code = stop.code
    return code, err.getvalue()


#: What each writing command reads (its output may not be one of them, nor hold one).
READS = {
    "import-edges": {"edges.txt"},
    "import-npz": {"g.npz"},
    "prepare": {"graph"},
    "partition": {"graph"},
    "partition-streamed": {"graph"},
    "consolidate": {"run"},
}
#: What the commands without an output write: the report its plots.
ALSO_WRITES = {"report": "run/plots/"}


@FUZZ
@given(case=cases())
def test_random_commands_on_damaged_inputs_change_nothing_but_their_output(
    pristine, monkeypatch, case
):
    command, out, overwrite, damage = case
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    writes = command in READS
    target = "fresh-output" if out == "new" else out
    argv = [a.replace("{out}", target) for a in COMMANDS[command]]
    if overwrite and writes and command != "consolidate":
        argv.append("--overwrite")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(shutil.copytree(pristine, Path(tmp) / "ws"))
        _damage(root, *damage)
        before = _snapshot(root, None)
        with contextlib.chdir(root):  # back before the folder goes
            code, err = _run(argv)
        after = _snapshot(root, None)
    assert "Traceback" not in err, err
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        lines = [line for line in err.strip("\n").split("\n") if line]
        assert len(lines) == 1 and ": error: " in lines[0], (argv, err)
    changed = {k for k in before if after.get(k) != before[k]}
    added = set(after) - set(before)
    if code != 0:
        assert not changed | added, (argv, err, sorted(changed | added)[:4])
        return
    # a success changes files only in its own output: new ones anywhere under it, existing
    # ones only where that output is a folder of its own kind, not one of its inputs
    mine = ALSO_WRITES.get(command) or (f"{target}/" if writes and target != "." else None)
    if command == "consolidate":  # one file, wherever it was asked for
        mine = os.path.normpath(f"{target}/model.pt")
    outside = {k for k in changed | added if mine is None or not k.startswith(mine)}
    assert not outside, (argv, sorted(outside)[:4])
    if writes and target in READS[command]:
        assert not changed, (argv, sorted(changed)[:4])
