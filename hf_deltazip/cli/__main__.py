"""``python -m hf_deltazip.cli``: the same as the ``deltazip`` command."""

from . import main

raise SystemExit(main())
