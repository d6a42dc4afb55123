"""Every cheap `unison` command the README and the guides show runs as written.

The commands are read out of the fenced code blocks of README.md, docs/*.md and examples/*/README.md:
`unison plan`, `unison estimate-memory`, `unison env`, and any `unison ... --help`. Synopses with
placeholders (`TARGET`, `[--devices N]`) are not commands and are skipped. They run in-process through
the CLI's own entry point, from the repository root as a reader would (a subprocess each would cost
seconds of start-up); launches and training runs are tested elsewhere, with their results checked.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest
from launching import REPO_ROOT

from unison.commands.main import main

DOCUMENTS = ["README.md", *sorted(str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob("docs/*.md"))]
DOCUMENTS += sorted(str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob("examples/*/README.md"))
CHEAP = ("plan", "estimate-memory", "env")
PLACEHOLDER = re.compile(r"\b[A-Z]{3,}\b|\[")  # TARGET, [--devices N]: a synopsis, not a command


def documented_commands() -> list[tuple[str, str]]:
    """(document, command line) for each cheap unison command in a fenced block, continuations joined."""
    found = []
    for document in DOCUMENTS:
        text = (REPO_ROOT / document).read_text()
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                command = line.split(" #")[0].strip()
                words = command.split()
                if len(words) < 2 or words[0] != "unison" or PLACEHOLDER.search(command):
                    continue
                if words[1] in CHEAP or "--help" in words:
                    found.append((document, command))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_each_kind_of_cheap_command():
    kinds = {command.split()[1] for _, command in COMMANDS} | {
        "--help" for _, command in COMMANDS if "--help" in command
    }
    assert {"plan", "estimate-memory", "env", "--help"} <= kinds, COMMANDS


@pytest.mark.parametrize("document, command", COMMANDS, ids=[command for _, command in COMMANDS])
def test_documented_command_runs_as_written(document, command, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            code = main(shlex.split(command)[1:])
        except SystemExit as stop:  # --help exits through argparse
            code = stop.code
    assert code in (0, None), f"{document}: `{command}` exited {code}:\n{output.getvalue()}"
    assert output.getvalue().strip(), f"{document}: `{command}` printed nothing"
    assert os.getcwd() == str(REPO_ROOT)
