#!/usr/bin/env bash
# Command 2: install what is missing (library and test tools), prove the library works in a fresh
# environment with only its declared dependencies (scripts/check_fresh_env.sh, about a minute), then
# run the whole test suite. Extra arguments go to pytest; UNISON_SKIP_FRESH_ENV=1 skips the fresh
# environment for a quick local re-run (CI never sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
if [ "${UNISON_SKIP_FRESH_ENV:-0}" != "1" ]; then
  bash scripts/check_fresh_env.sh
fi
exec "${PYTHON:-python3}" -m pytest "$@"
