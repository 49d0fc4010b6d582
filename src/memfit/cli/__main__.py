"""``python -m memfit.cli``: the same as the ``memfit`` command."""

from memfit.cli import main

raise SystemExit(main())
