"""The error every process raises alike when processes disagree about a collective.

`unison.ops` raises it before a collective runs; the failure handling (`failure`) recognises it to name
each rank's call in one report instead of one traceback per rank. It lives here, below both, so that
health never imports the collectives. Public as `unison.ops.DistributedOperationException`.
"""

from __future__ import annotations


class DistributedOperationException(ValueError):
    """Processes called a collective with different operations, structures, shapes or dtypes; raised on
    every process before the collective runs (Accelerate's name; a ValueError, as unison's other errors
    about the caller's input)."""
