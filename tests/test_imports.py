"""`import unison` and the `unison` commands cost what `import torch` costs: the heavier torch engines
(DTensor, FSDP2, pipelining, distributed checkpoint, torch._dynamo) load only where a layout uses them.

Imported up front they added 1.1 s to every `unison launch` before its first worker started, and to
`unison plan` / `env` / `estimate-memory` (parallel/engines.py says how they are deferred). Checked in
a fresh interpreter, since this test process has imported them all already.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from slowness import budget

import unison.checkpoint

HEAVY_ENGINES = (
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch._dynamo",
)

# What `unison launch` imports before it hands over to torch.distributed.run (which imports none).
LAUNCHER_IMPORTS = """
import json, sys
import unison
import unison.commands.main
import unison.launching.launcher
from torch.distributed import run
print(json.dumps([name for name in {engines} if name in sys.modules]))
"""


def test_import_unison_and_its_commands_loads_no_heavy_engine():
    result = subprocess.run(
        [sys.executable, "-c", LAUNCHER_IMPORTS.format(engines=HEAVY_ENGINES)],
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the file `path` of `package`, relative ones resolved; for
    `from X import name`, both X and X.name (name may be a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def test_the_checkpoint_package_does_not_import_the_accelerator():
    """checkpoint/ serves the façade (accelerator.py imports it and hands it a TrainingParts), so none of
    its modules imports unison.accelerator, not even for type checking: lower rooms never import upper
    ones (design.md), and a cycle would make the order of imports matter."""
    package = Path(unison.checkpoint.__file__).parent
    offenders = [
        f"{path.name}:{line} imports {module}"
        for path in sorted(package.glob("*.py"))
        for line, module in imported_modules(path, "unison.checkpoint")
        if module == "unison.accelerator" or module.startswith("unison.accelerator.")
    ]
    assert offenders == []
