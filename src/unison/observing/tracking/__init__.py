"""Experiment tracking with Accelerate's API: `Accelerator(log_with=...)`, `init_trackers`, `log`,
`get_tracker`, `end_training`. See base.py for the interface and files.py for the built-in trackers."""

from .base import GeneralTracker, LoggerType
from .files import CSVTracker, JSONLinesTracker

__all__ = ["CSVTracker", "GeneralTracker", "JSONLinesTracker", "LoggerType"]
