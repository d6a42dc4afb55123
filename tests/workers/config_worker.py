"""Launched by tests/test_config_file.py. Usage: config_worker.py OUT_DIR [CODE_ACCUMULATION].

Writes what this rank's Accelerator saw to OUT_DIR/rank{R}.json, and on rank 0 the settings lines
`unison env` prints inside the launch. CODE_ACCUMULATION: given in code, as
Accelerator(gradient_accumulation_steps=CODE_ACCUMULATION).
"""

import json
import os
import sys
from pathlib import Path

from unison import Accelerator
from unison.commands import env


def main() -> None:
    out = Path(sys.argv[1])
    code = {"gradient_accumulation_steps": int(sys.argv[2])} if len(sys.argv) > 2 else {}
    accelerator = Accelerator(**code)
    seen = {
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
        "UNISON_TIMEOUT": os.environ.get("UNISON_TIMEOUT"),
    }
    if accelerator.is_main_process:
        seen["settings"] = env.collect()["settings"]
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(seen))
    accelerator.end_training()


if __name__ == "__main__":
    main()
