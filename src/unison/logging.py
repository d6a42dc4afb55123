"""`get_logger`: Accelerate's multi-process logger (accelerate.logging), for scripts that use it.

Each record is emitted on the main process only unless the call says `main_process_only=False`;
`in_order=True` has every process emit it, one process after the other (a barrier between turns, so
every process must make the call). Unlike Accelerate's, the message carries no "[RANK i]" prefix:
`unison launch` already prefixes every line a worker prints with its rank.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from .state import PartialState

LOG_LEVEL = "UNISON_LOG_LEVEL"  # the level get_logger sets when its caller gives none


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger whose calls take `main_process_only` (default True) and `in_order` (default False)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs.setdefault("stacklevel", 2)  # the caller's file and line, not this adapter's
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not PartialState._shared_state:
            raise RuntimeError(
                "get_logger's logger needs to know which process this is: create the Accelerator (or "
                "PartialState()) before the first log call."
            )
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        state = PartialState()
        if not in_order:
            if state.is_main_process or not main_process_only:
                self.logger.log(level, msg, *args, **kwargs)
            return
        for turn in range(state.num_processes):
            if turn == state.process_index:
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    @functools.lru_cache(None)  # noqa: B019 - the adapter lives as long as the program, as its logger
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """warning(), emitted once for the same arguments (Accelerate's, for warnings inside loops)."""
        self.warning(*args, **{"stacklevel": 3, **kwargs})  # the caller of warning_once


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger `name` wrapped for several processes; `log_level` (else UNISON_LOG_LEVEL, if set)
    becomes the level of this logger and of the root logger, as in Accelerate."""
    log_level = log_level or os.environ.get(LOG_LEVEL)
    logger = logging.getLogger(name)
    if log_level:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
