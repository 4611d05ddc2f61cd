"""``python -m chaos run SCRIPT ...``: the same as ``meshvisor chaos run``."""

import sys

from ._cli import main

sys.exit(main(prog="python -m chaos"))
