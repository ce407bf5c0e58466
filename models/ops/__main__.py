"""``python -m models.ops`` (``models.ops.cli``)."""

from models.ops.cli import main

raise SystemExit(main())
