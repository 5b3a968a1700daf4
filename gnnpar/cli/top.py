"""The ``gnnpar`` command: ``gnnpar info | data | ...``.

Each sub-command lives in its own module and registers itself here; this file only builds the
parser, relaunches under torchrun when ``--nprocs`` asks for several processes, and turns
expected errors into one clear line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from gnnpar.atomic import os_error_message
from gnnpar.errors import UserError


class CLIError(UserError):
    """An error the user can fix; printed as one line, exit code 2."""


#: Errors the user can fix: one line, exit code 2. A UserError is a problem with what the
#: user gave (gnnpar.errors; CLIError, ConfigError, GridError, FormatError... are ones). An
#: OSError is the operating system refusing something about the user's files, disk or
#: network, and error_message names the path and the reason: a missing or existing path, a
#: permission, a full disk (ENOSPC, a plain OSError), an address in use. gnnpar raises no
#: OSError for its own invariants, so every one counts, plain OSError included; a peer's lost
#: connection (a ConnectionError) is told apart by is_secondary when it is reported. Anything
#: else, a bare ValueError, TypeError or KeyError included, is a bug: its traceback, exit 1.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, OSError)


def _cmd_info(args: argparse.Namespace) -> int:
    from gnnpar import info

    check_nprocs(args.nprocs)
    if args.check and args.nprocs > 1 and not _launched():
        from gnnpar.launch import launch_local, strip_nprocs

        return launch_local(args.nprocs, strip_nprocs(args.argv), agent=args.launch_agent)
    if not args.check:
        for title, table in (("versions", info.versions()), ("environment", info.environment())):
            print(f"{title}:")
            for k, v in table.items():
                print(f"  {k:<16} {v}")
        return 0
    return _info_check(args)


def check_nprocs(nprocs: int) -> None:
    """``--nprocs`` must name at least one process."""
    if nprocs < 1:
        raise CLIError(f"--nprocs must be at least 1, got {nprocs}")


def _launched() -> bool:
    from gnnpar.launch import under_launcher

    return under_launcher()


def _info_check(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import gnnpar
    from gnnpar import info
    from gnnpar.grid import default_shape, parse_grid_spec
    from gnnpar.launch import detect_launch

    launch = detect_launch()
    world = launch.world_size if launch is not None else 1
    shape = parse_grid_spec(args.grid) if args.grid else default_shape(world)
    grid = gnnpar.init(**shape, ranks_per_node=args.ranks_per_node)
    try:
        if grid.global_rank == 0:
            print(f"launcher: {launch.describe() if launch else 'none (one process)'}")
            print(f"{grid.describe()}: probing collectives with {args.mbytes} MB buffers")
        entries = info.probe(grid, nbytes=int(args.mbytes * (1 << 20)), iters=args.iters)
        if grid.global_rank == 0:
            if entries:
                print(info.format_table(entries))
            else:
                print("one rank: no collectives to probe (use --nprocs N)")
            if args.json:
                info.write_table(args.json, grid, entries)
                print(f"wrote {args.json}")
            print("all collectives returned correct results")
    finally:
        if dist.is_initialized():
            dist.barrier()
        gnnpar.shutdown(grid)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its error on one line: the error and where to look, without
    the usage block (which buried the one line that matters; ``--help`` shows it). A value
    the user typed may hold a newline (``--batch-size=$'\\n0'``): it is shown escaped."""

    def error(self, message: str) -> NoReturn:  # noqa: D102
        message = message.replace("\n", "\\n")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # noqa: D102
        # argparse reports an unknown flag from the top parser ("see gnnpar --help"); the
        # sub-command's parser says it, whose --help lists the flags it takes
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            _innermost(self, parsed).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The parser of the sub-command that ``args`` names (``gnnpar train gcn``'s)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser of ``gnnpar``."""
    parser = _Parser(
        prog="gnnpar",
        description="Distributed training for GNNs on huge graphs and for large transformers.",
    )
    parser.add_argument(
        "--master-addr",
        metavar="HOST[:PORT]",
        default=None,
        help="rank 0's host (and port) under Slurm or MPI, as MASTER_ADDR / MASTER_PORT",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions and devices; --check probes collectives")
    p.add_argument("--check", action="store_true", help="run every collective on every axis")
    p.add_argument("--nprocs", type=int, default=1, help="local processes to start")
    p.add_argument("--grid", default=None, help="grid shape, e.g. x=2,y=2 (default: automatic)")
    p.add_argument("--mbytes", type=float, default=4.0, help="buffer size per collective")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per collective")
    p.add_argument("--ranks-per-node", type=int, default=None, help="simulate several nodes")
    p.add_argument("--json", default=None, help="write the bandwidth table to this JSON file")
    p.set_defaults(func=_cmd_info)

    from gnnpar.cli.ckpt import add_ckpt_commands
    from gnnpar.cli.data import add_data_commands
    from gnnpar.cli.generate import add_generate_command
    from gnnpar.cli.plan import add_plan_commands
    from gnnpar.cli.train import add_train_commands

    add_data_commands(sub)
    add_train_commands(sub)
    add_plan_commands(sub)
    add_ckpt_commands(sub)
    add_generate_command(sub)
    return parser


def error_message(err: BaseException) -> str:
    """An error as one line: an OS error names its path and says what is wrong with it."""
    text = os_error_message(err) if isinstance(err, OSError) else str(err)
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or repr(err)


def _release_distributed() -> None:
    """Tear down torch.distributed after an error, so that no communication thread is left
    running when the process exits (which aborts it: "terminate called without an active
    exception")."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError):
        pass  # a broken world: exiting is all that is left, and it exits cleanly now


def _a_rank() -> bool:
    """Whether a launcher started this process as one rank of several (False where the
    launch's environment is broken: the command reports that as its error)."""
    try:
        return _launched()
    except ValueError:
        return False


def _interrupt_once(signum: int, frame: object) -> None:
    """SIGINT in a rank: raise KeyboardInterrupt the first time and ignore the next ones."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _rank_interrupted_once() -> None:
    """A rank of a launch gets Ctrl-C twice: from the terminal, then from the launcher
    stopping it (torchrun forwards the signal it got). The second one would land in the
    rank's clean-up (closing the progress bar, leaving the process group) and print a
    traceback; the launcher kills a rank that does not end. Only the main thread can set
    a handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt_once)


def _report(args: argparse.Namespace, err: BaseException, code: int, detail: str = "") -> bool:
    """Report a failure once: to the launch agent when gnnpar launched this rank, else on
    stderr from the rank that should speak (rank 0 for an error every rank raises alike,
    none for a peer's lost connection). Returns whether it was reported at all."""
    from gnnpar.launch import ERROR_DIR_ENV, is_secondary, rank_and_world, record_failure

    message = error_message(err)
    if detail:
        message = f"{type(err).__name__}: {message}"
    rank, world = rank_and_world()
    directory = os.environ.get(ERROR_DIR_ENV)
    if world > 1 and directory:
        record_failure(directory, rank, message, code, detail, secondary=is_secondary(err))
        return True
    if world > 1:
        alike = getattr(err, "same_on_every_rank", False)
        if (alike and rank != 0) or is_secondary(err):
            return False
        if not alike:
            message = f"rank {rank} of {world}: {message}"
    if detail:
        return False  # a crash outside a gnnpar launch: Python's own traceback follows
    print(f"gnnpar {args.command}: error: {message}", file=sys.stderr, flush=True)
    return True


def _fail(args: argparse.Namespace, err: BaseException, code: int) -> int:
    _report(args, err, code)
    _release_distributed()
    return code


def console() -> int:
    """Entry point of the ``gnnpar`` console script (and ``python -m gnnpar.cli``):
    :func:`main`, with a local launch's agent forked before the command does any work."""
    return main(fork_agent=True)


def _will_launch(args: argparse.Namespace) -> bool:
    """Whether the command may start ranks here (``--nprocs`` above 1 outside a launcher)."""
    return getattr(args, "nprocs", 1) > 1 and not _launched()


def main(argv: Sequence[str] | None = None, fork_agent: bool = False) -> int:
    """Run one ``gnnpar`` command; return its exit code. ``fork_agent``: a command that may
    launch local ranks forks their launch agent first (:class:`gnnpar.launch.ForkedAgent`;
    only in a process that has done nothing else yet, as the console script has)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # what a local launch hands to each rank
    args.launch_agent = None
    if _a_rank():
        _rank_interrupted_once()
    if fork_agent and _will_launch(args):
        from gnnpar.launch import ForkedAgent

        args.launch_agent = ForkedAgent.start()
    try:
        return _main(args)
    finally:
        if args.launch_agent is not None:
            args.launch_agent.close()


def _main(args: argparse.Namespace) -> int:
    from gnnpar.train.loop import NonFiniteLossError

    try:
        if args.master_addr:
            from gnnpar.launch import apply_master_addr

            apply_master_addr(args.master_addr)
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        return _fail(args, e, 2)
    except NonFiniteLossError as e:
        return _fail(args, e, 1)
    except KeyboardInterrupt as stop:
        from gnnpar.launch import ReportedInterrupt

        _release_distributed()
        # the launch agent (or launcher) speaks for a launch, once, not each rank
        if not (isinstance(stop, ReportedInterrupt) or _a_rank()):
            print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # A bug or a broken peer: under a gnnpar launch the agent prints the root cause's
        # traceback once; elsewhere Python's own traceback (a peer's lost connection: none).
        reported = _report(args, e, 1, detail=traceback.format_exc())
        _release_distributed()
        if reported or is_rank_echo(e):
            return 1
        raise


def is_rank_echo(err: BaseException) -> bool:
    """Whether ``err``, in one rank of several, only echoes a peer's failure (so this rank
    stays silent: the failing rank reports)."""
    from gnnpar.launch import is_secondary, rank_and_world

    return rank_and_world()[1] > 1 and is_secondary(err)
