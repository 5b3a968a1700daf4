"""``python -m gnnpar.cli``: the ``gnnpar`` command."""

import sys

from gnnpar.cli.top import console

sys.exit(console())
