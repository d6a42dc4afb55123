"""mkdocs hook: publish the repository files that the docs link to outside docs/, so those links work
both on GitHub (where they are plain relative links) and on the site.

A page such as docs/zero.md links to `../benchmarks/README.md`: right on GitHub, outside the site for
mkdocs. Rather than relax link validation, each such target that exists is added to the site under
`repo/` (benchmarks/README.md becomes the page repo/benchmarks/README.md, a .py file a static copy), the
link is rewritten to it, and links inside a published markdown file are resolved from where it lives in
the repository. A link to a file that exists nowhere is left alone, so mkdocs' strict validation still
fails on it, as it does on a broken link between docs pages.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

PREFIX = "repo"
# an inline markdown link's target: ](target) or ](target "title"); the anchor is kept apart
LINK = re.compile(r"\]\((?P<path>[^)\s#]+)(?P<rest>[^)]*)\)")

_published: dict[Path, str] = {}  # absolute path of a repository file -> its src_uri on the site


def _repo_root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _target(source: Path, link: str) -> Path | None:
    """The file a relative link in `source` points at, or None for URLs, absolute paths and anchors."""
    if "://" in link or link.startswith(("/", "mailto:")):
        return None
    return (source.parent / link).resolve()


def on_files(files: Files, config: MkDocsConfig) -> Files:
    repo, docs = _repo_root(config), Path(config.docs_dir).resolve()
    _published.clear()
    pending = [Path(f.abs_src_path) for f in files.documentation_pages() if f.abs_src_path]
    while pending:
        source = pending.pop()
        for match in LINK.finditer(source.read_text(encoding="utf-8")):
            target = _target(source, match["path"])
            if target is None or target in _published or not target.is_file():
                continue
            if docs in target.parents or repo not in target.parents:
                continue
            _published[target] = f"{PREFIX}/{target.relative_to(repo).as_posix()}"
            files.append(
                File.generated(
                    config, _published[target], abs_src_path=str(target), inclusion=InclusionLevel.NOT_IN_NAV
                )
            )
            if target.suffix == ".md":
                pending.append(target)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point links at the site's copy of a repository file, or, from a published repository page, at
    the docs page its relative link meant."""
    docs = Path(config.docs_dir).resolve()
    source = Path(page.file.abs_src_path).resolve()
    here = PurePosixPath(page.file.src_uri).parent

    def rewrite(match: re.Match[str]) -> str:
        target = _target(source, match["path"])
        if target is None:
            return match[0]
        if target in _published:
            uri = _published[target]
        elif docs in target.parents and docs not in source.parents:
            uri = target.relative_to(docs).as_posix()
        else:
            return match[0]
        relative = PurePosixPath(*[".."] * len(here.parts), uri) if here.parts else PurePosixPath(uri)
        return f"]({relative}{match['rest']})"

    return LINK.sub(rewrite, markdown)
