"""``python -m fedlight`` is the ``fedlight`` command."""

import sys

from fedlight.cli import main

sys.exit(main())
