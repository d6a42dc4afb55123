"""`python -m unison ...` is the `unison` console script."""

import sys

from .commands.main import console_main

sys.exit(console_main())
