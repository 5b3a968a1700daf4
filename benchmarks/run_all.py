"""Run every benchmark in this folder and collect their tables into ``RESULTS.md``.

Each script runs in its own process (so peak memory and threads are its own) with a time
limit; its printed tables go into ``benchmarks/RESULTS.md`` under its name, with the machine,
the date and the command. JSON results stay in ``benchmarks/out/``.

    python benchmarks/run_all.py                 # every benchmark
    python benchmarks/run_all.py fullgraph       # only those whose name contains a word
    python benchmarks/run_all.py --quick         # every script with --quick (a smoke run)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    """Run the benchmarks; return non-zero if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("only", nargs="*", help="run only benchmarks whose name contains these")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="pass --quick to every script: small inputs, minutes in all (checks the machinery)",
    )
    parser.add_argument(
        "--summary",
        default=None,
        help="the Markdown summary (RESULTS.md; RESULTS-quick.md with --quick)",
    )
    args = parser.parse_args()
    scripts = sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name)
    if args.only:
        scripts = [p for p in scripts if any(w in p.stem for w in args.only)]
    suffix, flag = ("-quick", " --quick") if args.quick else ("", "")
    sections, failed = [], []
    for script in scripts:
        print(f"== {script.name}", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, str(script), *(["--quick"] if args.quick else [])],
                capture_output=True,
                text=True,
                timeout=args.timeout,
                cwd=HERE.parent,
            )
            output, ok = proc.stdout, proc.returncode == 0
            if not ok:
                output += f"\n(exit code {proc.returncode})\n{proc.stderr[-3000:]}"
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            output += f"\n(stopped after {args.timeout:.0f}s)"
            ok = False
        seconds = time.perf_counter() - start
        print(output, flush=True)
        if not ok:
            failed.append(script.name)
        sections.append(
            f"## {script.stem}\n\n`python benchmarks/{script.name}{flag}` ({seconds:.0f}s"
            f"{'' if ok else ', FAILED'})\n\n```\n{output.strip()}\n```\n"
        )
    header = (
        "# Benchmark results\n\n"
        f"{datetime.date.today()} on {platform.platform()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}. Written by `make bench{suffix}` "
        f"(`python benchmarks/run_all.py{flag}`); "
        "JSON in `benchmarks/out/`.\n\n"
        + (
            "**Quick run** (`--quick`: small inputs; a smoke test, not the figures to quote).\n\n"
            if args.quick
            else ""
        )
    )
    target = Path(args.summary or HERE / ("RESULTS-quick.md" if args.quick else "RESULTS.md"))
    tmp = target.with_suffix(".md.tmp")
    tmp.write_text(header + "\n".join(sections))
    tmp.replace(target)
    print(f"wrote {target}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
