"""The command line, one module a command: the top command ``gnnpar`` (:mod:`.top`: the
parser, the launch under torchrun, one line per user error), ``train`` / ``evaluate`` /
``predict`` / ``report`` (:mod:`.train`), ``plan`` (:mod:`.plan`), ``ckpt`` (:mod:`.ckpt`),
``data`` (:mod:`.data`) and ``generate`` (:mod:`.generate`). ``python -m gnnpar.cli`` is ``gnnpar``.

It sits above everything else: it reads the workloads from the train-spec registry
(:mod:`gnnpar.train.spec`), and nothing in gnnpar imports it.
"""

from gnnpar.cli.top import USER_ERRORS, CLIError, build_parser, console, main

__all__ = ["USER_ERRORS", "CLIError", "build_parser", "console", "main"]
