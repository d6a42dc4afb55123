"""The house's layout, read from the code's own imports: no import circles, each wing imports only the
wings its row of docs/architecture.md allows, and the top of src/unison stays small.

Every import counts: module-level, inside functions, and under `if TYPE_CHECKING:` (a type hint that
points up is still a lower layer knowing an upper one). A circle makes the order of imports matter and
a lower layer that imports an upper one cannot be read, tested or replaced without it: where a lower
layer needs a name, the name moves down (env_vars, health.mismatch, parallel.checkpointing_modes,
launching.errors are such moves), it is not imported inside a function.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from slowness import budget

import unison

PACKAGE = Path(unison.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

# The training loop: the top of the core, which plans (planning) and reports (observing).
LOOP = {"unison.accelerator", "unison.preparation", "unison.local_sgd"}
# Public import paths that re-export names from the wings below them.
FACADE = {"unison", "unison.utils", "unison.throughput"}
WINGS = ("health", "core", "planning", "observing", "loop", "launching", "facade", "commands")
# wing -> the other wings it may import (docs/architecture.md's "may import" column)
MAY_IMPORT = {
    "health": set(),
    "core": {"health"},
    "planning": {"health", "core"},
    "observing": {"health", "core"},
    "loop": {"health", "core", "planning", "observing"},
    "launching": {"health", "core", "observing"},
    "facade": {"health", "core", "planning", "observing", "loop", "launching"},
    "commands": {"health", "core", "planning", "observing", "loop", "launching", "facade"},
}
MAX_TOP_LEVEL_MODULES = 25


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def wing_of(module: str) -> str:
    if module in FACADE:
        return "facade"
    if module in LOOP:
        return "loop"
    parts = module.split(".")
    if module == "unison.__main__":
        return "commands"
    if len(parts) > 1 and parts[1] in ("health", "planning", "observing", "launching", "commands"):
        return parts[1]
    return "core"


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports anywhere in its file. `from X import name` counts
    X.name when that is a module, else X; a module's own parent packages are not counted (importing a
    submodule runs them already)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imports_of(module, path, known) for module, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), i.e. the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    """The check above cannot pass by finding nothing: a made-up graph with one circle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_each_wing_imports_only_the_wings_below_it():
    breaches = [
        f"{module} ({wing_of(module)}) imports {target} ({wing_of(target)})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if wing_of(target) != wing_of(module) and wing_of(target) not in MAY_IMPORT[wing_of(module)]
    ]
    assert breaches == []


def test_the_architecture_page_states_the_rule_this_test_enforces():
    """docs/architecture.md's table has one row per wing, and its "may import" cell names exactly the
    wings MAY_IMPORT allows, so the page the next engineer reads first is the rule that holds."""
    rows = {}
    for line in ARCHITECTURE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("**"):
            wing = cells[0].strip("*").split()[0].lower()
            rows[wing] = set(re.findall(r"\b(" + "|".join(WINGS) + r")\b", cells[-1].lower()))
    assert rows == MAY_IMPORT


def test_the_top_of_the_package_stays_small():
    top = sorted(
        path.name for path in PACKAGE.glob("*.py") if path.name not in ("__init__.py", "__main__.py")
    )
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_the_lazy_public_names_are_the_imported_ones():
    """unison/__init__.py loads its public names on first use (_EXPORTS), and imports them for type
    checkers under TYPE_CHECKING: both lists, and __all__, name the same things, and each resolves."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    typed = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for child in node.body
        if isinstance(child, ast.ImportFrom)
        for alias in child.names
    }
    assert typed == set(unison._EXPORTS)
    assert set(unison.__all__) == typed | {"__version__"}
    assert all(getattr(unison, name) is not None for name in unison.__all__)


def test_the_commands_help_runs_without_torch():
    """`unison --help` and every `unison COMMAND --help` print with torch unimportable: help must not
    wait for torch (1.5 s on a quiet machine, 30 s under load), nor need it."""
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from unison.commands.main import build_parser, main\n"
        "commands = [a for a in build_parser()._actions if a.dest == 'command'][0].choices\n"
        "for argv in [['--help']] + [[name, '--help'] for name in commands]:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as end:\n"
        "        assert end.code == 0, (argv, end.code)\n"
        "print('commands:', ' '.join(commands))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=budget(120)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "commands: launch env config estimate-memory plan plot" in result.stdout
