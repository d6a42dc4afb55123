"""Launched worker: the GPT example's training (examples/gpt/train.py, its own main()) once per layout,
in turn, in one launch.

Arguments: a JSON list of [layout, [train.py's arguments]]. For each, the layout is set where
`unison launch --parallelism LAYOUT` puts it (UNISON_PARALLELISM, read by the example's Accelerator()),
the Accelerator's state is reset (a new layout for each run, as the combination matrix does) and
train.py's main() runs with those arguments. Before each run process 0 prints "==== run LAYOUT" (the
launcher prefixes it "[rank0]: "), so the test splits the output by run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))
import train  # noqa: E402  (examples/gpt/train.py)

from unison import PartialState, env_vars  # noqa: E402
from unison.state import AcceleratorState, GradientState  # noqa: E402

MARK = "==== run "


def main() -> None:
    state = PartialState()
    for layout, arguments in json.loads(sys.argv[1]):
        os.environ[env_vars.PARALLELISM] = layout
        AcceleratorState._reset_state()
        GradientState._reset_state()
        state.wait_for_everyone()  # the previous run's lines are out before the next run's mark
        if state.is_main_process:
            print(f"{MARK}{layout}", flush=True)
        sys.argv = ["train.py", *map(str, arguments)]
        train.main()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
