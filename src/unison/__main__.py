"""`python -m unison ...` is the `unison` console script."""

import sys

from .commands.main import main

sys.exit(main())
