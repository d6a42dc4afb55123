"""mkdocs hook: the CLI reference page (docs/cli.md) is written at build time from the argparse parsers
themselves (unison.commands.main.build_parser()), so it cannot drift from `unison COMMAND --help`.

The page's `<!-- cli-reference -->` marker is replaced by one section per subcommand: its one-line help,
description, usage, a table of flags per argument group (every spelling of each flag) and the epilog.
The parsers are imported from this checkout's src/, not from whichever unison is installed.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

MARKER = "<!-- cli-reference -->"
PAGE = "cli.md"


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its {MARKER} line: put it back where the reference goes.")
    return markdown.replace(MARKER, render(_build_parser(config)))


def _build_parser(config: MkDocsConfig) -> argparse.ArgumentParser:
    src = str(Path(config.config_file_path).resolve().parent / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from unison.commands.main import build_parser

    return build_parser()


def render(parser: argparse.ArgumentParser) -> str:
    """Markdown for every subcommand of `parser`, in the order `unison --help` lists them."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {choice.dest: choice.help for choice in action._choices_actions}
    sections = [f"```text\n{parser.format_usage().strip()}\n```\n"]
    for name, sub in action.choices.items():
        sections.append(f"## unison {name}\n")
        if summaries.get(name):
            sections.append(f"*{_text(summaries[name])}*\n")
        if sub.description:
            sections.append(_text(sub.description) + "\n")
        sections.append(f"```text\n{sub.format_usage().strip()}\n```\n")
        for group in sub._action_groups:
            rows = [_row(a, sub.prog) for a in group._group_actions if a.help != argparse.SUPPRESS]
            if rows:
                sections.append(f"**{_text(group.title or '')}**\n\n| argument | meaning |\n| --- | --- |")
                sections.append("\n".join(rows) + "\n")
        if sub.epilog:
            sections.append(f"```text\n{sub.epilog.strip()}\n```\n")
    return "\n".join(sections)


def _row(action: argparse.Action, prog: str) -> str:
    names = action.option_strings or [action.metavar or action.dest]
    value = ""
    if action.option_strings and action.nargs != 0:
        metavar = action.metavar or (
            "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
        )
        value = f" {metavar}"
    spelled = ", ".join(f"`{name}{value}`" for name in names)
    help_text = (action.help or "") % dict(vars(action), prog=prog) if action.help else ""
    return f"| {spelled} | {_text(help_text)} |"  # a | inside `code` does not split a table cell


def _text(text: str) -> str:
    """Help text as markdown: HTML-escaped, on one line, `code` kept, emphasis and table pipes escaped."""
    parts = " ".join(html.escape(text, quote=False).split()).split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans at all
        parts = ["\\`".join(parts)]
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("*", r"\*").replace("_", r"\_").replace("|", r"\|")
    return "`".join(parts)
