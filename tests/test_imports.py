"""`import unison` and the `unison` commands cost what `import torch` costs: the heavier torch engines
(DTensor, FSDP2, pipelining, distributed checkpoint, torch._dynamo) load only where a layout uses them.

Imported up front they added 1.1 s to every `unison launch` before its first worker started, and to
`unison plan` / `env` / `estimate-memory` (parallel/engines.py says how they are deferred). Checked in
a fresh interpreter, since this test process has imported them all already.
"""

from __future__ import annotations

import json
import subprocess
import sys

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
import unison.launcher
from torch.distributed import run
print(json.dumps([name for name in {engines} if name in sys.modules]))
"""


def test_import_unison_and_its_commands_loads_no_heavy_engine():
    result = subprocess.run(
        [sys.executable, "-c", LAUNCHER_IMPORTS.format(engines=HEAVY_ENGINES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
