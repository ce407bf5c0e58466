"""``python -m server.cli``: the ``kvserve`` command."""

import sys

from server.cli import main

sys.exit(main())
