"""``python -m meshvisor``: the same as the ``meshvisor`` command."""

import sys

from meshvisor._cli import main

sys.exit(main())
