"""The documentation runs: every shell command and Python snippet of README.md, docs/*.md,
datasets/README.md and the examples' docstrings, top to bottom, page by page.

Each page runs in a folder of its own laid out like the checkout (``examples/``,
``benchmarks/``, ``.venv/``, ``../shared/datasets``), with one ``datasets/`` data root that
all pages share, so a page's commands see what its earlier commands made and nothing of
another page's. Python blocks of a page share one interpreter, as when pasted into one
session. Blocks marked ``# no-run: REASON`` are compiled (Python) or parsed by ``bash -n``,
and every ``gnnpar``, ``gnnpar-partition``, example and benchmark command in them must name
flags that exist. What a block may say about its test: ``tests/doc_blocks.py``. Every relative
link of the Markdown pages names a file that exists, and a heading of it where it names one.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gnnpar.launch import _AGENT
from tests.conftest import DATASETS, REQUIRE
from tests.doc_blocks import (
    LINE_NO_RUN,
    PYTHON,
    ROOT,
    SHELL,
    Block,
    blocks,
    commands,
    logical_lines,
    pages,
)
from tests.process_tree import run_tree

PAGES = pages()
#: The pages with something to run (docs/devices.md and docs/formats.md only describe).
RUN_PAGES = [p for p in PAGES if any(b.runnable for b in blocks(p))]
ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b|: error: ")
RANK_ERROR = re.compile(r"^\[rank\d+\]:.*(Error|Exception)\b|: error: ")
MARKDOWN = [p for p in PAGES if p.suffix == ".md"]
FENCE_LINE = re.compile(r"^\s*```")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
LINKED = ("examples", "benchmarks", "tests", "gnnpar", "partitioners", "Makefile",
          "pyproject.toml", "README.md")  # fmt: skip


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.fixture(scope="module")
def docs_base(tmp_path_factory) -> Path:
    """``base/shared/datasets`` (the real datasets) and ``base/data`` (the pages' data root)."""
    base = tmp_path_factory.mktemp("docs")
    (base / "shared").mkdir()
    if DATASETS.is_dir():
        (base / "shared" / "datasets").symlink_to(DATASETS)
    (base / "data").mkdir()
    return base


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GNNPAR_DATA", "PYTEST_CURRENT_TEST")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    bin_dir = str(Path(sys.executable).parent)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        MPLBACKEND="Agg",
        PYTHONUNBUFFERED="1",
    )
    return env


def _page_folder(base: Path, page: Path) -> Path:
    folder = base / _page_id(page).replace("/", "_").replace(".", "_")
    folder.mkdir()
    for name in LINKED:
        (folder / name).symlink_to(ROOT / name)
    (folder / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (folder / "datasets").symlink_to(base / "data")
    return folder


def _needs_datasets(page: Path) -> None:
    if "../shared/datasets" in page.read_text() and not (DATASETS / "planetoid").is_dir():
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{_page_id(page)} reads ../shared/datasets: missing {DATASETS}")
        pytest.skip(f"{_page_id(page)} reads ../shared/datasets, which is missing here")


class _PythonSession:
    """One interpreter per page (tests/doc_python.py) that runs its Python blocks in turn."""

    def __init__(self, folder: Path, env: dict[str, str], log: Path):
        self.log_path = log
        self.log = log.open("ab")
        read, write = os.pipe()
        self.answers = os.fdopen(read, "r")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "doc_python.py"), str(write)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, cwd=folder, env=env,
            pass_fds=(write,), text=True,
        )  # fmt: skip
        os.close(write)

    def run(self, block: Block) -> tuple[bool, str]:
        start = self.log_path.stat().st_size
        request = {"code": block.to_run(), "name": block.where}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], block.timeout)
        if not ready:
            self.close()
            return False, f"timed out after {block.timeout:.0f} s\n" + self._since(start)
        line = self.answers.readline()
        ok = bool(line) and json.loads(line)["ok"]
        return ok, self._since(start)

    def _since(self, start: int) -> str:
        self.log.flush()
        with self.log_path.open("rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _run_shell(
    block: Block, folder: Path, env: dict[str, str], text: str | None = None
) -> tuple[bool, str]:
    argv = ["bash", "-eo", "pipefail", "-c", text or block.to_run()]
    code, out = run_tree(argv, timeout=block.timeout, cwd=folder, env=env)
    if code is None:  # the ranks' stacks end the output
        return False, f"{TIMED_OUT} {block.timeout:.0f} s\n{out}"
    return code == 0, out


def _run_on_processes(block: Block, folder: Path, env: dict[str, str]) -> tuple[bool, str]:
    """A Python block saved as a script and started on ``block.nprocs`` processes."""
    script = folder / f"block_{block.line}.py"
    script.write_text(block.to_run())
    # torchrun's launcher, in gnnpar's launch agent: the ranks are forked after one import of
    # torch instead of each starting an interpreter (seconds of CPU per rank).
    command = (
        f"{sys.executable} -c {shlex.quote(_AGENT)} --standalone "
        f"--nproc-per-node {block.nprocs} {script.name}"
    )
    return _run_shell(block, folder, env, command)


#: How a block that ran past its time limit begins its output.
TIMED_OUT = "timed out after"


def _excerpt(text: str) -> str:
    """The first error in ``text`` with the lines before it, then its last lines: a rank's
    traceback (``[rankN]:`` lines) comes before the launcher's long report, a one-line error
    (``error:``) before anything else."""
    lines = text.rstrip().splitlines()
    if len(lines) <= 60:
        return "\n".join(lines)
    if text.startswith(TIMED_OUT):  # the hung processes' stacks are the end: keep them
        return "\n".join([lines[0], "...", *lines[-400:]])
    first = None
    for pattern in (RANK_ERROR, ERROR_LINE):
        first = next((i for i, ln in enumerate(lines) if pattern.search(ln)), None)
        if first is not None:
            break
    tail = lines[-15:]
    if first is None or first >= len(lines) - 15:
        return "\n".join(lines[-60:])
    return "\n".join([*lines[max(0, first - 25) : first + 5], "...", *tail])


@pytest.mark.parametrize("page", RUN_PAGES, ids=_page_id)
def test_page_runs_top_to_bottom(page: Path, docs_base: Path) -> None:
    """Every runnable block of the page, in order, in a fresh folder: each must succeed."""
    page_blocks = blocks(page)
    _needs_datasets(page)
    folder = _page_folder(docs_base, page)
    env = _environment()
    python: _PythonSession | None = None
    try:
        for block in page_blocks:
            if block.file is not None:
                (folder / block.file).write_text(block.text)
                continue
            if not block.runnable:
                continue
            start = time.perf_counter()
            if block.nprocs is not None:
                ok, output = _run_on_processes(block, folder, env)
            elif block.lang in PYTHON:
                python = python or _PythonSession(folder, env, folder / "python.log")
                ok, output = python.run(block)
            else:
                ok, output = _run_shell(block, folder, env)
            took = time.perf_counter() - start
            print(f"{block.where}: {'ok' if ok else 'FAILED'} in {took:.1f} s")
            if not ok:
                pytest.fail(
                    f"{block.where} ({block.lang}) failed after {took:.1f} s:\n"
                    f"{block.to_run().rstrip()}\n--- output (end) ---\n{_excerpt(output)}",
                    pytrace=False,
                )
    finally:
        if python is not None:
            python.close()
        shutil.rmtree(folder / "runs", ignore_errors=True)  # big; the rest is small


# ------------------------------------------------------------ blocks that are not run
def _program(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(program, its arguments)`` of a documented command, past launchers and ``python``:
    ``gnnpar``, ``gnnpar-partition``, ``make`` or a script path; None for anything else."""
    for i, word in enumerate(argv):
        if word == "-m" and i + 1 < len(argv) and argv[i + 1] == "gnnpar.cli":
            return "gnnpar", argv[i + 2 :]
        if word.endswith(".py"):
            return word, argv[i + 1 :]
        name = word.rsplit("/", 1)[-1]
        if name in ("gnnpar", "gnnpar-partition"):
            return name, argv[i + 1 :]
        if word == "make" and i == 0:
            return "make", argv[1:]
    return None


def _gnnpar_error(args: list[str]) -> str | None:
    from gnnpar.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(args)
    except SystemExit as exit_:
        if exit_.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


@functools.cache
def _help_text(program: str, sub: str) -> str:
    """The ``--help`` of a script or ``gnnpar-partition`` (and its sub-command)."""
    if program == "gnnpar-partition":
        from partitioners.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            main([*([sub] if sub else []), "--help"])
        return out.getvalue()
    proc = subprocess.run(
        [sys.executable, str(ROOT / program), "--help"], capture_output=True, text=True,
        timeout=120, cwd=ROOT, env=_environment(),
    )  # fmt: skip
    return proc.stdout


def flag_errors(text: str) -> list[str]:
    """What is wrong with the commands of a shell block, without running them: unknown
    ``gnnpar`` flags or values (its own parser), flags a script or ``gnnpar-partition``
    does not list in ``--help``, ``make`` targets the Makefile lacks, missing scripts."""
    errors = []
    for argv in commands(text):
        argv = ["0" if "$" in word else word for word in argv]  # a shell variable: any value
        found = _program(argv)
        if found is None:
            continue
        program, args = found
        if program == "gnnpar":
            problem = _gnnpar_error(args)
        elif program == "make":
            targets = (ROOT / "Makefile").read_text()
            missing = [t for t in args if "=" not in t and f"\n{t}:" not in targets]
            problem = f"no make target {missing[0]}" if missing else None
        elif program != "gnnpar-partition" and not (ROOT / program).is_file():
            problem = f"no script {program}"
        else:
            sub = args[0] if args and args[0] in ("inspect", "compare") else ""
            usage = _help_text(program, sub if program == "gnnpar-partition" else "")
            unknown = [a.split("=")[0] for a in args if a.startswith("--")]
            unknown = [a for a in unknown if a not in usage]
            problem = f"unknown flag(s) {', '.join(unknown)}" if unknown else None
        if problem:
            errors.append(f"{' '.join(argv)}: {problem}")
    return errors


def _unrun_parts(block: Block) -> str | None:
    """The text of a block that is not run: all of a no-run block, else its no-run lines."""
    if block.no_run is not None:
        return block.text
    lines = [ln for ln in logical_lines(block.text) if LINE_NO_RUN.search(ln)]
    return "\n".join(lines) if block.lang in SHELL and lines else None


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_blocks_that_are_not_run_are_checked(page: Path) -> None:
    """No-run blocks still parse and name real flags; every fence names its language, so
    no command hides in a block the tests skip."""
    problems = []
    for block in blocks(page):
        if not block.lang:
            problems.append(f"{block.where}: a fence without a language (text, json, ...)")
            continue
        text = _unrun_parts(block)
        if text is None:
            continue
        if block.lang in PYTHON:
            try:
                compile(text, block.where, "exec")
            except SyntaxError as err:
                problems.append(f"{block.where}: {err}")
        elif block.lang in SHELL:
            proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
            if proc.returncode:
                problems.append(f"{block.where}: bash -n: {proc.stderr.strip()}")
            problems += [f"{block.where}: {e}" for e in flag_errors(text)]
    assert not problems, "\n".join(problems)


def test_the_flag_check_catches_a_wrong_command() -> None:
    """The check the no-run blocks rely on fails on what a stale page would say."""
    assert flag_errors("gnnpar train gcn --epochs 3 --grid x=2\n") == []
    assert flag_errors("gnnpar train gcn --no-such-flag 3\n")
    assert flag_errors("torchrun --nproc-per-node 4 -m gnnpar.cli train gpt --stepz 3\n")
    assert flag_errors("gnnpar-partition sbm --parts 2 --out p --dataset-options n=5\n") == []
    assert flag_errors("gnnpar-partition compare sbm --parts 2 --colour red\n")
    assert flag_errors("python examples/train_gpt.py --steps 3 --n-layerz 2\n")
    assert flag_errors("python examples/no_such_example.py\n")
    assert flag_errors("make tset\n")


def test_every_test_directive_still_applies() -> None:
    """A size override whose text left the page is an error, not a silent full-size run."""
    for page in PAGES:
        for block in blocks(page):
            if block.runnable:
                block.to_run()  # raises naming the block and the directive


# ------------------------------------------------------------------------------- links
def _prose(path: Path) -> list[tuple[int, str]]:
    """``(line number, line)`` of a Markdown page outside its fenced blocks."""
    out, inside = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE_LINE.match(line):
            inside = not inside
        elif not inside:
            out.append((n, line))
    return out


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    """The anchors of a page's headings, as GitHub makes them (lower case, punctuation
    dropped, blanks to hyphens, ``-1``, ``-2`` for repeats)."""
    slugs, count = set(), {}
    for _, line in _prose(path):
        match = HEADING.match(line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(2).strip().lower()).replace(" ", "-")
            slugs.add(f"{slug}-{count[slug]}" if slug in count else slug)
            count[slug] = count.get(slug, 0) + 1
    return frozenset(slugs)


def link_errors(page: Path) -> list[str]:
    """The relative links of a Markdown page whose file, or heading, does not exist."""
    errors = []
    for n, line in _prose(page):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                errors.append(f"{page.name}:{n}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                errors.append(f"{page.name}:{n}: {target}: no such heading in {dest.name}")
    return errors


@pytest.mark.parametrize("page", MARKDOWN, ids=_page_id)
def test_relative_links_resolve(page: Path) -> None:
    """A page moved or a heading renamed cannot leave a link pointing nowhere."""
    assert not link_errors(page), "\n".join(link_errors(page))


def test_the_link_check_catches_a_broken_link(tmp_path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` part: here\n\n## Twice\n## Twice\n")
    page.write_text(
        "# Page\n\n[ok](other.md#a-code-part-here) [ok](other.md#twice-1) [ok](#page)\n"
        "[web](https://example.org/x) `[code](nowhere.md)`\n```text\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) [no heading](other.md#nothing) [self](#nothing)\n"
    )
    assert [e.split(": ", 1)[1] for e in link_errors(page)] == [
        "missing.md: no such file",
        "other.md#nothing: no such heading in other.md",
        "#nothing: no such heading in page.md",
    ]


HANGS = """
import sys, time
from gnnpar.launch import stacks_on_request
stacks_on_request()
def waits_for_its_peers():
    print("started", flush=True)
    time.sleep(600)
waits_for_its_peers()
"""


def test_a_hung_command_is_killed_with_its_processes_and_their_stacks_shown(tmp_path):
    """A block past its time limit: the stacks of the processes it started (a rank stuck in
    ``waits_for_its_peers``, two levels down) end the output, and none of them is left."""
    (tmp_path / "hangs.py").write_text(HANGS)
    block = Block(
        source=ROOT / "README.md", line=1, lang="bash", text="", directives=("timeout 8",)
    )
    command = f"{sys.executable} hangs.py & wait"
    ok, out = _run_shell(block, tmp_path, {**_environment(), "PYTHONPATH": str(ROOT)}, command)
    assert not ok and out.startswith(TIMED_OUT)
    assert "started" in out and "in waits_for_its_peers" in out, out
    left = subprocess.run(["pgrep", "-f", "hangs.py"], capture_output=True, text=True).stdout
    assert not left.strip(), f"still running: {left}"
