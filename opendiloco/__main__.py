"""``python -m opendiloco``: the same as the ``opendiloco`` command."""

import sys

from opendiloco.cli import main

sys.exit(main())
