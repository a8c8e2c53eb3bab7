"""``python -m fiber_bundle.cli``: the ``fiber-bundle`` command."""

import sys

from . import main

sys.exit(main())
