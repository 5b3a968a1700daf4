"""Line coverage of the whole suite, and every public function that no test executes.

Runs pytest under coverage.py (the ranks of ``gnnpar.testing`` worlds and the processes the
command-line tests start are measured too: see ``[tool.coverage]`` in pyproject.toml), prints
the per-file report, then lists each public function or method of ``gnnpar`` and
``partitioners`` none of whose statements ran. Each must appear in ``unexecuted.toml`` next to
this file with the reason it is not run; the exit status is 1 when one is missing (or listed
but executed after all, so the list stays honest).

    python tests/coverage_report/run.py                 # the whole suite
    python tests/coverage_report/run.py --no-run        # report on the last .coverage data
    python tests/coverage_report/run.py -- tests/test_comm.py   # pytest arguments
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gnnpar", "partitioners")
REASONS = Path(__file__).with_name("unexecuted.toml")


def public_functions(path: Path) -> list[tuple[str, int, int]]:
    """``(qualified name, first body line, last line)`` of every public function and method
    (public class, name without a leading underscore) with a body beyond its docstring."""
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def body_span(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int] | None:
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if not body or all(isinstance(s, (ast.Pass, ast.Expr)) for s in body):
            return None  # a protocol stub or an abstract placeholder
        return body[0].lineno, fn.end_lineno

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            span = body_span(node)
            if span and not node.name.startswith("_"):
                out.append((node.name, *span))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    span = body_span(item)
                    if span and not item.name.startswith("_"):
                        out.append((f"{node.name}.{item.name}", *span))
    return out


def unexecuted(cov) -> list[str]:
    """``file:qualname`` of every public function none of whose statements ran."""
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            _, statements, _, missing, _ = cov.analysis2(str(path))
            ran = set(statements) - set(missing)
            rel = path.relative_to(ROOT).as_posix()
            for name, first, last in public_functions(path):
                if not any(first <= line <= last for line in ran):
                    out.append(f"{rel}:{name}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="only report on .coverage")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    if not args.no_run:
        for old in ROOT.glob(".coverage*"):
            old.unlink()
        cmd = [sys.executable, "-m", "coverage", "run", "-m", "pytest", "--timeout=1200", "-q"]
        status = subprocess.call(cmd + args.pytest_args)
        subprocess.check_call([sys.executable, "-m", "coverage", "combine", "-q"])
        if status not in (0, 1):
            return status
    import coverage

    cov = coverage.Coverage()
    cov.load()
    cov.report(skip_covered=False, sort="cover")
    missing = unexecuted(cov)
    with open(REASONS, "rb") as f:
        reasons: dict[str, str] = tomllib.load(f)
    unexplained = [m for m in missing if m not in reasons]
    stale = sorted(set(reasons) - set(missing))
    print(f"\n{len(missing)} public functions never executed; {len(unexplained)} without a reason")
    for name in missing:
        print(f"  {name}: {reasons.get(name, 'NO REASON GIVEN')}")
    for name in stale:
        print(f"  listed in {REASONS.name} but executed (or gone): {name}")
    return 1 if unexplained or stale else 0


if __name__ == "__main__":
    sys.exit(main())
