"""The code blocks of the documentation, as the documentation tests run them.

Sources: fenced blocks of README.md, docs/*.md and datasets/README.md, and the command lines
of the examples' docstrings. What a block may say about how it is tested:

- a first line ``# no-run: REASON`` (visible to readers): the block needs a cluster, a GPU, a
  download or more than a minute; it is checked for syntax and for flags that exist, not run.
  A single command line of a shell block may carry ``# ... (no-run: REASON)`` instead;
- hidden directives, one per line right before the fence (``<!-- test: ... -->``):
  ``OLD => NEW`` replaces text before running (size overrides), ``PREFIX += FLAGS`` appends
  flags to every command that starts with ``PREFIX`` (``gnnpar train gcn += --epochs 3``),
  ``file NAME`` writes the block to ``NAME`` instead of running it (a config a later block
  reads), ``nprocs N`` runs a Python block alone on N processes under torchrun (a snippet
  that needs a world of N), ``timeout SECONDS`` raises the time limit of the block;
- an example's docstring: ``(The documentation tests run these with ``FLAGS``.)`` appends
  ``FLAGS`` to each of its commands.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELL = ("bash", "sh", "shell")
PYTHON = ("python",)
NO_RUN = re.compile(r"^\s*#\s*no-run:\s*(\S.*)$")
LINE_NO_RUN = re.compile(r"\(no-run:\s*([^)]+)\)")
DIRECTIVE = re.compile(r"^\s*<!--\s*test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(.*)$")
EXAMPLE_FLAGS = re.compile(r"documentation tests run these with ``([^`]+)``")
COMMAND_WORDS = ("python", "torchrun", "gnnpar", "srun", "mpirun", "mpiexec", "make")


def pages() -> list[Path]:
    """Every documented page whose blocks the tests run, in a stable order."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found += [ROOT / "datasets" / "README.md", *sorted((ROOT / "examples").glob("*.py"))]
    return found


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block (or an example docstring's commands) and what it says about tests."""

    source: Path
    line: int  # 1-based line of the opening fence (or of the first command)
    lang: str
    text: str
    directives: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.source.relative_to(ROOT)}:{self.line}"

    @property
    def no_run(self) -> str | None:
        """The reason this block is not run, if its first line gives one."""
        first = next((ln for ln in self.text.splitlines() if ln.strip()), "")
        match = NO_RUN.match(first)
        return match.group(1).strip() if match else None

    @property
    def runnable(self) -> bool:
        return self.lang in SHELL + PYTHON and self.no_run is None and self.file is None

    @property
    def file(self) -> str | None:
        """``NAME`` of a ``file NAME`` directive: the block is written there, not run."""
        for d in self.directives:
            if d.startswith("file "):
                return d[5:].strip()
        return None

    @property
    def nprocs(self) -> int | None:
        """``N`` of an ``nprocs N`` directive: the Python block runs alone as a script on N
        processes (torchrun), as its first comment tells the reader to."""
        for d in self.directives:
            if d.startswith("nprocs "):
                return int(d.split()[1])
        return None

    @property
    def timeout(self) -> float:
        for d in self.directives:
            if d.startswith("timeout "):
                return float(d.split()[1])
        return 240.0

    def to_run(self) -> str:
        """The text to execute: line-level no-run commands removed, directives applied."""
        if self.lang in PYTHON:
            text = self.text
        else:
            text = "\n".join(
                ":" if LINE_NO_RUN.search(ln) else ln for ln in logical_lines(self.text)
            )
        for d in self.directives:
            if "=>" in d:
                old, new = (s.strip() for s in d.split("=>", 1))
                if old not in text:
                    raise ValueError(f"{self.where}: directive {d!r}: {old!r} is not in the block")
                text = text.replace(old, new)
            elif "+=" in d:
                prefix, flags = (s.strip() for s in d.split("+=", 1))
                changed = "\n".join(_append(ln, prefix, flags) for ln in text.splitlines())
                if changed == text:
                    raise ValueError(f"{self.where}: directive {d!r}: no command starts so")
                text = changed
        return text


def _append(line: str, prefix: str, flags: str) -> str:
    """``line`` with ``flags`` after its command when the command starts with ``prefix``."""
    code, comment = split_comment(line)
    bare = code.strip()
    for lead in ("", ".venv/bin/"):
        if bare.startswith(lead + prefix):
            return f"{code.rstrip()} {flags}{'  ' + comment if comment else ''}"
    return line


def split_comment(line: str) -> tuple[str, str]:
    """``(code, comment)`` of a shell line: the comment starts at a ``#`` after a blank,
    outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
    return line, ""


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined (comments kept)."""
    out: list[str] = []
    pending = ""
    for line in text.splitlines():
        code, comment = split_comment(line)
        if code.rstrip().endswith("\\"):
            pending += code.rstrip()[:-1] + " "
            continue
        out.append(pending + line.strip() if pending else line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def commands(text: str) -> list[list[str]]:
    """The argv of each simple command in a shell block (comments, loops' keywords and
    ``VAR=value`` prefixes dropped; ``a; b`` and ``a && b`` split)."""
    out = []
    for line in logical_lines(text):
        code, _ = split_comment(line)
        try:
            words = shlex.split(code, posix=True)
        except ValueError:
            continue
        current: list[str] = []
        for w in [*words, ";"]:
            if w in (";", "&&", "||", "|", "do", "done", "then", "fi"):
                if current:
                    out.append(current)
                current = []
            else:
                current.append(w)
    keywords = ("for", "while", "if", "cd", "export", "echo")
    return [c for c in out if c and c[0] not in keywords]


def markdown_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the directives right above each."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, info = match.group(1), match.group(2).strip()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].startswith(indent + "```"):
            body.append(lines[i][len(indent):])
            i += 1
        directives = []
        j = start - 1
        while j >= 0 and DIRECTIVE.match(lines[j]):
            directives.insert(0, DIRECTIVE.match(lines[j]).group(1))
            j -= 1
        lang = info.split()[0] if info else ""
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", tuple(directives)))
        i += 1
    return blocks


def docstring_blocks(path: Path) -> list[Block]:
    """An example's docstring commands as one shell block (they run in order)."""
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    flags = EXAMPLE_FLAGS.search(" ".join(doc.split()))
    lines, first, inside = [], None, False
    for n, line in enumerate(doc.splitlines()):
        stripped = line.strip()
        if line.startswith("    ") and (inside or stripped.split(" ")[0] in COMMAND_WORDS):
            lines.append(stripped.replace("\\\\", "\\"))
            first = n if first is None else first
            inside = stripped.endswith("\\")
        else:
            inside = False
    if not lines:
        return []
    prefixes = [f"python examples/{path.name}"]
    prefixes += ["torchrun"] if any(ln.startswith("torchrun") for ln in lines) else []
    directives = () if not flags else tuple(f"{p} += {flags.group(1)}" for p in prefixes)
    return [Block(path, first + 2, "bash", "\n".join(lines) + "\n", directives)]


def blocks(path: Path) -> list[Block]:
    """The blocks of any page."""
    return docstring_blocks(path) if path.suffix == ".py" else markdown_blocks(path)
