"""README.md stays a front door: one screen to the first run, every capability one row linking to its guide.

Measurements and proofs live in the docs pages (docs/status.md, docs/test-suite.md, docs/torch-versions.md);
the README only points at them, so these checks hold it to its shape and to what the demo really prints.
The commands it shows are run by tests/test_docs_commands.py.
"""

from __future__ import annotations

import re

from launching import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
NAV = (REPO_ROOT / "mkdocs.yml").read_text()


def test_the_readme_fits_in_120_lines_with_its_four_parts():
    assert len(README.splitlines()) <= 120, "README.md is a front door: move details to a docs/ page"
    headings = re.findall(r"^## (.+)$", README, flags=re.M)
    assert headings == ["The two commands", "30-second example", "What it does", "Links"], headings


def test_each_row_of_what_it_does_is_one_line_linking_to_a_published_guide():
    section = README.split("## What it does", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    rows = [row for row in rows if not row.startswith("| ---")]
    assert len(rows) >= 15, rows
    for row in rows:
        pages = re.findall(r"\]\(docs/([\w-]+\.md)(?:#[\w-]+)?\)", row)
        assert pages, f"a row without a guide: {row}"
        for page in pages:
            assert (REPO_ROOT / "docs" / page).is_file(), f"{row}: docs/{page} does not exist"
            assert f": {page}" in NAV, f"docs/{page} is not in mkdocs.yml's nav"


def test_the_readme_quotes_no_measurement_the_docs_do_not_keep():
    """Numbers with a unit or a ratio (57 s, 1.7e-5, 0.53x, 98.61%) are measurements: docs/ holds them."""
    docs = "\n".join(page.read_text() for page in (REPO_ROOT / "docs").glob("*.md"))
    measured = re.findall(r"\b\d[\d,.]*(?:e-\d+| ?s\b| ?ms\b|x\b|%)", README)
    assert [number for number in measured if number not in docs] == []


def test_the_plot_command_the_demo_prints_is_the_one_the_readme_promises():
    train = (REPO_ROOT / "examples" / "gpt" / "train.py").read_text()
    promised = "pip install 'unison[plot]' && unison plot"
    assert promised in README
    assert f"plot them: {promised} " in train
