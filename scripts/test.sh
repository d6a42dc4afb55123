#!/usr/bin/env bash
# Command 2: install what is missing (library and test tools), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec "${PYTHON:-python3}" -m pytest "$@"
