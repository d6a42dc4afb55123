"""The documentation site builds in strict mode, and its generated reference pages say what the code says.

`python -m mkdocs build --strict` (mkdocs.yml) fails on any warning: a broken link or anchor between
pages, a link to a repository file that does not exist, a docstring mkdocstrings cannot render. The CLI
reference is compared with the argparse parsers themselves, flag for flag, and the API reference with
Accelerator.prepare's own docstring.
"""

from __future__ import annotations

import argparse
import html
import inspect
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launching import REPO_ROOT
from slowness import budget

from unison import Accelerator
from unison.commands.main import build_parser

pytest.importorskip("mkdocs", reason="the site needs the docs extra: pip install 'unison[docs]'")
pytest.importorskip("material", reason="the site needs the docs extra: pip install 'unison[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=budget(240),
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner about its successor
    )
    assert built.returncode == 0, built.stderr
    assert not re.search(r"^(WARNING|ERROR)\b", built.stderr, flags=re.M), built.stderr
    return site_dir


def _sections(page: str) -> dict[str, str]:
    """The HTML of each `<h2 id=...>` section of a page, by id."""
    parts = re.split(r'<h2 id="([^"]+)"', page)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_nav_page_and_linked_repository_file_is_built(site: Path):
    for page in ("index.html", "concepts/index.html", "zero/index.html", "cli/index.html", "api/index.html"):
        assert (site / page).is_file(), page
    # docs/zero.md links to ../benchmarks/README.md: published with the site, the link pointed at it
    assert (site / "repo/benchmarks/index.html").is_file()
    assert 'href="../repo/benchmarks/#strategiespy' in (site / "zero/index.html").read_text()


def test_cli_reference_lists_every_subcommand_and_flag_of_the_parser(site: Path):
    sections = _sections((site / "cli/index.html").read_text())
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sections) == {f"unison-{name}" for name in subparsers.choices}
    for name, sub in subparsers.choices.items():
        section = sections[f"unison-{name}"]
        documented = set(re.findall(r"<code>(--?[\w-]+)", section))
        shown = [action for action in sub._actions if action.help != argparse.SUPPRESS]
        flags = {flag for action in shown for flag in action.option_strings}
        usage_flags = set(re.findall(r"\[(--?[\w-]+)", sub.format_usage()))
        assert documented == flags, f"unison {name}: documented {documented ^ flags} differ"
        assert usage_flags <= documented, name
        for action in shown:
            if action.help:
                words = " ".join(html.escape(action.help.split("`")[0], quote=False).split()[:4])
                assert words in section, f"unison {name} {action.option_strings}: {action.help!r}"


def test_api_reference_has_accelerator_prepare_docstring(site: Path):
    page = (site / "api/index.html").read_text()
    assert 'id="unison.Accelerator.prepare"' in page
    for paragraph in inspect.getdoc(Accelerator.prepare).split("\n\n"):
        assert html.escape(" ".join(paragraph.split()), quote=False) in " ".join(page.split()), paragraph


def test_a_broken_link_fails_the_strict_build(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    docs = tmp_path / "docs"
    shutil.copytree(REPO_ROOT / "docs", docs)
    (tmp_path / "benchmarks").symlink_to(REPO_ROOT / "benchmarks")  # what the copied pages link to
    (docs / "api.md").write_text("# API reference\n")  # its docstrings are checked above; this saves seconds
    with (docs / "zero.md").open("a") as page:
        page.write("\n[a page](no-such-page.md) and [a repository file](../no/such/file.py)\n")
    config = load_config(str(REPO_ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(tmp_path / "site"))
    with caplog.at_level(logging.WARNING, logger="mkdocs"), pytest.raises(Abort, match="2 warnings"):
        build(config)
    assert "'no-such-page.md'" in caplog.text and "'../no/such/file.py'" in caplog.text, caplog.text
