#!/usr/bin/env bash
# Run the whole test suite under the oldest torch unison declares (pyproject.toml's torch>=X.Y), in a
# virtual environment of its own, so the declared floor stays a tested one. Not part of CI: before 2.13
# PyPI's Linux torch wheels are CUDA builds (about 3 GB to download, 5 GB installed), and the suite runs
# once more. Run it when the floor, or code that touches a torch engine, changes. The suite runs on the
# CPU as in CI; a machine with GPUs runs tests/test_cuda.py too.
#   bash scripts/check_torch_floor.sh                  the declared floor (X.Y.* : its newest patch)
#   bash scripts/check_torch_floor.sh 2.11.0 -x -q     another version; further arguments go to pytest
# UNISON_FLOOR_VENV names the environment (default: $TMPDIR/unison-torch-VERSION, kept for re-runs).
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^dependencies = \["torch>=\([0-9]*\.[0-9]*\)".*/\1/p' pyproject.toml)
[ -n "$floor" ] || { echo "[floor] no torch>=X.Y first in pyproject.toml's dependencies" >&2; exit 2; }
version="${1:-$floor.*}"
[ $# -gt 0 ] && shift
venv="${UNISON_FLOOR_VENV:-${TMPDIR:-/tmp}/unison-torch-${version//\*/x}}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "torch==$version"
"$venv/bin/python" -m pip install --quiet -e ".[test]"
echo "[floor] $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') in $venv"
exec "$venv/bin/python" -m pytest "$@"
