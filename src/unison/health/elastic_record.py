"""The error file torch's elastic agent reads, written with the exact time of the failure.

Both ways a rank ends after a failure write it: its own uncaught error (`failure`) and the watchdog
ending it for another rank's report (`watchdog`); `unison launch` and `notebook_launcher` read the
extra fields to name the rank that failed first.
"""

from __future__ import annotations

import contextlib
import json
import os
import time


def record_for_the_elastic_agent(rank: str, message: str, text: str, consequence: bool = False) -> None:
    """Write the error file torch's elastic agent reads (as its @record would), with the exact time.

    torch's own timestamp has whole seconds, too coarse to tell the rank that failed first from the
    peers that failed 0.2 s later because it went away; `unison launch` and `notebook_launcher` name
    the rank with the smallest `unison_failed_at` among those whose failure was not a `consequence` of
    another's (ended by the watchdog, or a peer that went away).
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    extra = {
        "py_callstack": text,
        "timestamp": str(int(now)),
        "unison_failed_at": now,
        "unison_rank": rank,
        "unison_consequence": consequence,
    }
    with contextlib.suppress(OSError), open(path, "w") as file:
        json.dump({"message": {"message": message, "extraInfo": extra}}, file)
