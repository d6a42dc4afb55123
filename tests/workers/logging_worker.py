"""Launched worker: unison.logging.get_logger as Accelerate scripts use it.

Usage: logging_worker.py LOG_FILE. Every process appends its records to LOG_FILE as
"<file>:<line> <message>", flushed per record, so the file shows which processes emitted what, in order.
"""

from __future__ import annotations

import logging
import sys

from unison import Accelerator
from unison.logging import get_logger

handler = logging.FileHandler(sys.argv[1], mode="a")
handler.setFormatter(logging.Formatter("%(filename)s:%(lineno)d %(message)s"))
logging.getLogger(__name__).addHandler(handler)
logger = get_logger(__name__, log_level="INFO")
accelerator = Accelerator(cpu=True)
logger.info("main only %d", accelerator.process_index)
logger.info("everyone %d", accelerator.process_index, main_process_only=False)
for _ in range(3):
    logger.warning_once("once per process", main_process_only=False)
logger.debug("below the level", main_process_only=False)
accelerator.wait_for_everyone()
logger.info("in order %d", accelerator.process_index, in_order=True)
