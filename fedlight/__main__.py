"""``python -m fedlight`` is the ``fedlight`` command."""

import sys

from fedlight.config.cli import main

sys.exit(main())
