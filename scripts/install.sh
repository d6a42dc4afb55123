#!/usr/bin/env bash
# Install what is missing for unison into the Python on PATH (or $PYTHON), and nothing more.
#   bash scripts/install.sh          the library
#   bash scripts/install.sh test     the library and its test tools
# torch: an installed torch >= 2.12 (pyproject's floor) is kept. Otherwise torch==2.13.0 is installed: on our CPU build
# machines pip finds that exact version as a local CPU wheel; on a GPU machine it is PyPI's CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if ! "$PY" - <<'PYCODE' 2>/dev/null
import sys
import torch
major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 12) else 1)
PYCODE
then
  echo "[install] torch >= 2.12 not found: installing torch==2.13.0"
  "$PY" -m pip install --quiet "torch==2.13.0"
fi

extras=""
[ "${1:-}" = "test" ] && extras="[test]"
# Reinstall unison only when this checkout is not the one Python imports, or test tools are missing.
if ! "$PY" - "$extras" <<'PYCODE' 2>/dev/null
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("unison")
assert spec is not None and pathlib.Path(spec.origin).resolve().parents[1] == (pathlib.Path.cwd() / "src").resolve()
if sys.argv[1]:
    import mlflow, numpy, pytest, pytest_timeout, safetensors, xdist, tensorboard, transformers, wandb  # noqa: F401
    import accelerate, datasets, peft  # noqa: F401
    import sklearn  # noqa: F401
    import material, mkdocs, mkdocstrings_handlers.python  # noqa: F401
    import tomli_w, yaml  # noqa: F401
    import matplotlib, tqdm  # noqa: F401
PYCODE
then
  echo "[install] installing unison${extras} from $(pwd)"
  "$PY" -m pip install --quiet -e ".${extras}"
fi
