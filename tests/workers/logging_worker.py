"""Launched worker: unison.logging.get_logger as Accelerate scripts use it.

Usage: logging_worker.py LOG_FILE, or `run(LOG_FILE)` (tests/workers/accelerate_style_worker.py calls it
on 3 processes, after its own work, with the state reset). Every process appends its records to
LOG_FILE as "<file>:<line> <message>", flushed per record, so the file shows which processes emitted
what, in order.
"""

from __future__ import annotations

import logging
import sys

from unison import Accelerator
from unison.logging import get_logger


def run(log_file) -> None:
    handler = logging.FileHandler(log_file, mode="a")
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
    handler.close()


if __name__ == "__main__":
    run(sys.argv[1])
