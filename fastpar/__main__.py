"""``python -m fastpar``: the same command line as the ``fastpar`` script."""

import sys

from .cli import main

sys.exit(main())
