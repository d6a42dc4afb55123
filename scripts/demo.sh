#!/usr/bin/env bash
# Command 1: install what is missing, then train the GPT example on 2 CPU processes (a real gloo group).
# Extra arguments go to examples/gpt/train.py, e.g. `bash scripts/demo.sh --max-steps 50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m unison launch --nproc-per-node 2 --cpu examples/gpt/train.py "$@"
