"""The mutation check: apply each curated one-line bug, run the tests that own the code, and
report which bugs the suite catches.

The bugs live in ``mutants.toml`` next to this file, one ``[[mutant]]`` table each::

    [[mutant]]
    id = "comm-broadcast-full"            # unique, short
    file = "gnnpar/comm.py"               # from the repository root
    original = "ring_bytes(\"broadcast\", _nbytes(tensor), len(members))"
    mutated = "_nbytes(tensor)"           # replaces ``original``, which must occur once
    tests = ["tests/test_comm.py"]        # pytest arguments: the owning test files
    kind = "wrong ring factor"            # what sort of bug
    bug = "broadcast counted as the whole buffer"
    survives = "..."                      # only for a known survivor: why no test fails

The check copies the tree once into a temporary folder and, for each mutant, writes the
mutated file there, runs ``pytest -x`` on its test files (so a caught mutant stops at the
first failure) and restores the file. It never touches the working tree. A mutant whose
``original`` text no longer occurs exactly once is reported ``stale`` (the code moved on;
update the entry). Exit status 0 when every mutant is caught or has a written reason to
survive, 1 otherwise.

Why not mutmut or cosmic-ray: their mutants are generated (operator swaps everywhere), not
a curated list of plausible bugs, and both rerun tests through their own runners, whose
per-mutant bookkeeping does not follow the forked ranks of ``gnnpar.testing`` worlds. A list
of entries also lets other modules (e.g. the checkpoint code) add their mutants in one place.

    python tests/mutants/run.py                  # every mutant
    python tests/mutants/run.py comm-broadcast-full zero3-rs-fp32   # some
    python tests/mutants/run.py --list           # the list, no runs
    python tests/mutants/run.py --markdown out.md   # also write the table
    python tests/mutants/run.py comm-allreduce-half --tests tests/test_fullgraph.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
LIST = Path(__file__).with_name("mutants.toml")
SKIP_DIRS = {
    ".git",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    "runs",
    "build",
    "out",
}
FIELDS = {"id", "file", "original", "mutated", "tests", "kind", "bug", "survives"}


@dataclass
class Mutant:
    """One curated bug (see the module docstring for the fields)."""

    id: str
    file: str
    original: str
    mutated: str
    tests: list[str]
    kind: str
    bug: str
    survives: str = ""


@dataclass
class Outcome:
    """What the tests made of one mutant."""

    mutant: Mutant
    status: str  # caught, survived, stale, timeout
    seconds: float
    detail: str  # the first failing test, or why it is stale


def load(path: Path = LIST) -> list[Mutant]:
    """The mutants of ``path``; ValueError naming the entry for a malformed one."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    out, seen = [], set()
    for i, entry in enumerate(data.get("mutant", [])):
        name = entry.get("id", f"entry {i}")
        missing = sorted({"id", "file", "original", "mutated", "tests", "kind", "bug"} - set(entry))
        extra = sorted(set(entry) - FIELDS)
        if missing or extra:
            raise ValueError(f"{path.name}: mutant {name}: missing {missing}, unknown {extra}")
        if name in seen:
            raise ValueError(f"{path.name}: mutant id {name} appears twice")
        if entry["original"] == entry["mutated"]:
            raise ValueError(f"{path.name}: mutant {name} changes nothing")
        seen.add(name)
        out.append(Mutant(**entry))
    return out


def _ignore(folder: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n in SKIP_DIRS or n.endswith(".egg-info")}
    if Path(folder) == ROOT / "datasets":  # prepared datasets: large, and no test reads them
        skip |= {n for n in names if (Path(folder) / n).is_dir()}
    return skip


def _datasets() -> str:
    """Where the tests of the copy find the shared datasets (the copy lives elsewhere)."""
    return os.environ.get("GNNPAR_TEST_DATASETS") or str(ROOT.parent / "shared" / "datasets")


def run_one(m: Mutant, tree: Path, timeout: float) -> Outcome:
    """Apply ``m`` in ``tree``, run its tests, restore the file."""
    path = tree / m.file
    if not path.is_file():
        return Outcome(m, "stale", 0.0, f"{m.file} does not exist")
    text = path.read_text()
    count = text.count(m.original)
    if count != 1:
        return Outcome(m, "stale", 0.0, f"original text occurs {count} times in {m.file}")
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "PYTHONDONTWRITEBYTECODE": "1",  # a mutated module must never be cached
        "GNNPAR_TEST_DATASETS": _datasets(),
    }
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    cmd += [f"--timeout={int(timeout)}", *m.tests]
    path.write_text(text.replace(m.original, m.mutated))
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout + 60
        )
    except subprocess.TimeoutExpired:
        return Outcome(m, "timeout", time.monotonic() - start, "the tests hung")
    finally:
        path.write_text(text)
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return Outcome(m, "survived", seconds, "")
    if proc.returncode in (1, 2):  # failures, or an error collecting the tests
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
        return Outcome(m, "caught", seconds, failed[0] if failed else proc.stdout[-200:])
    raise RuntimeError(
        f"pytest could not run the tests of {m.id} (exit {proc.returncode}):\n{proc.stdout}"
        f"{proc.stderr}"
    )


def copy_tree(dest: Path) -> Path:
    """A copy of the checkout's sources and tests under ``dest``."""
    tree = dest / "tree"
    shutil.copytree(ROOT, tree, ignore=_ignore)
    return tree


def table(outcomes: list[Outcome]) -> str:
    """The markdown table of the outcomes, then the score."""
    lines = [
        "| mutant | file | bug | kind | outcome | first failing test / reason | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        m = o.mutant
        detail = o.detail if o.status != "survived" else f"survives: {m.survives or '(none)'}"
        lines.append(
            f"| {m.id} | `{m.file}` | {m.bug} | {m.kind} | {o.status} | {detail} "
            f"| {o.seconds:.0f} |"
        )
    caught = sum(o.status in ("caught", "timeout") for o in outcomes)
    counted = sum(o.status != "stale" for o in outcomes)
    score = 100.0 * caught / counted if counted else 0.0
    lines.append("")
    lines.append(f"{caught} of {counted} caught ({score:.0f}%).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per test run")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument(
        "--tests", nargs="+", help="run these test files instead of each mutant's own"
    )
    args = parser.parse_args(argv)
    mutants = load()
    if args.ids:
        unknown = sorted(set(args.ids) - {m.id for m in mutants})
        if unknown:
            parser.error(f"unknown mutant ids {unknown}")
        mutants = [m for m in mutants if m.id in args.ids]
    if args.tests:
        mutants = [dataclasses.replace(m, tests=args.tests) for m in mutants]
    if args.list:
        for m in mutants:
            print(f"{m.id:32s} {m.file:36s} {m.bug}")
        return 0
    outcomes = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gnnpar-mutants-") as tmp:
        tree = copy_tree(Path(tmp))
        for i, m in enumerate(mutants, 1):
            o = run_one(m, tree, args.timeout)
            outcomes.append(o)
            print(
                f"[{i}/{len(mutants)}] {m.id}: {o.status} ({o.seconds:.0f} s) {o.detail}",
                flush=True,
            )
    text = table(outcomes)
    print(f"\n{text}\n\nwall time {time.monotonic() - start:.0f} s")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    bad = [
        o
        for o in outcomes
        if o.status == "stale" or (o.status == "survived" and not o.mutant.survives)
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
