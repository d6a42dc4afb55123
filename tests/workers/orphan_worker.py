"""Launched by tests/test_launch.py, whose test SIGKILLs the launcher at some moment of this worker's start.

Usage: orphan_worker.py PID_DIR. Records this process's pid first (before importing torch), then forms the
group and sleeps: a worker left alive after its launcher died would sleep on, which the test detects.
"""

import os
import sys
from pathlib import Path

Path(sys.argv[1], f"{os.getpid()}.pid").write_text(str(os.getpid()))

import time  # noqa: E402

from unison import PartialState  # noqa: E402

PartialState()
time.sleep(120)
