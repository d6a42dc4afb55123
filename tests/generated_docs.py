"""Tables in the docs that tests generate from what they measured: checked, or rewritten on request.

A table sits between two HTML comments in a page. Run normally, the test fails when the page's table is
not the measured one; with the named environment variable set to 1 it writes the measured table there.
"""

from __future__ import annotations

import os
from pathlib import Path


def check_or_write(page: Path, start: str, end: str, table: str, write_variable: str) -> None:
    """Assert that `page` holds `table` between the comments `start` and `end`, or, when the environment
    variable `write_variable` is 1, put it there."""
    text = page.read_text()
    before, rest = text.split(start)
    _, after = rest.split(end)
    if os.environ.get(write_variable) == "1":
        page.write_text(f"{before}{start}\n{table}{end}{after}")
        return
    assert f"{start}\n{table}{end}" in text, (
        f"{page.name} is out of date (`{write_variable}=1` rewrites it); the runs give:\n{table}"
    )
