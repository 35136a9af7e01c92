"""``python -m flashrt.cli``: the same as the ``flashrt`` command."""
import sys

from .commands import main

sys.exit(main())
