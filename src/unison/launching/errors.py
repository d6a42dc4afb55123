"""The launch's two refusals, raised in the launcher before any worker starts: a wrong flag
(`LaunchError`) and a wrong config file (`ConfigError`). A leaf of the wing, so the flag and file
readers (`options`, `config_file`, `accelerate_config`, `plugin_flags`) can all raise them without
importing each other.
"""

from __future__ import annotations


class LaunchError(ValueError):
    """A launch flag is wrong; raised before any worker process starts."""


class ConfigError(ValueError):
    """The config file is missing, unreadable, or holds a key or value launch does not take."""
