#!/usr/bin/env bash
# Prove that `pip install unison` alone is enough: a fresh virtual environment gets torch (as
# install.sh takes it) and this checkout with NO extras, then imports unison, runs the CLI and trains
# the GPT example on 2 processes for a few steps. The test suite's environment always has numpy,
# pytest and safetensors, so it cannot see an undeclared dependency; this can. Fails on any error.
#   bash scripts/check_fresh_env.sh      (scripts/test.sh runs it before the suite)
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$(pwd)"
PY="${PYTHON:-python3}"
started=$SECONDS

workdir="$(mktemp -d -t unison-fresh-env-XXXXXX)"
trap 'rm -rf "$workdir"' EXIT
"$PY" -m venv "$workdir/venv"
venv_python="$workdir/venv/bin/python"

echo "[fresh env] installing torch and unison (no extras) into $workdir/venv"
"$venv_python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" 2>&1 \
  | grep -v "^WARNING: Location" || true
# A wheel build, not an editable install: what a user's `pip install unison` gets, package data included.
"$venv_python" -m pip install --quiet --disable-pip-version-check "$checkout" 2>&1 \
  | grep -v "^WARNING: Location" || true

# Run outside the checkout, so nothing is imported from its source tree by accident.
cd "$workdir"
"$venv_python" - <<'PYCODE'
import importlib.util
import unison
for extra in ("pytest", "safetensors", "tensorboard", "transformers", "mlflow", "wandb", "matplotlib", "tomli_w", "yaml", "sklearn"):  # test-only packages must not have come along
    assert importlib.util.find_spec(extra) is None, f"{extra} is installed: the fresh env is not bare"
print(f"[fresh env] import unison {unison.__version__} from {unison.__file__}")

# An optional extra that is missing fails with the command that installs it.
import torch
accelerator = unison.Accelerator(cpu=True)
model = accelerator.prepare(torch.nn.Linear(2, 2))
try:
    accelerator.save_model(model, "weights")
    raise SystemExit("save_model wrote safetensors without the safetensors package")
except ImportError as error:
    assert "pip install 'unison[safetensors]'" in str(error), error
print("[fresh env] save_model without safetensors names the extra: ok")
try:
    unison.Accelerator(cpu=True, log_with="tensorboard")
    raise SystemExit("log_with='tensorboard' was accepted without the tensorboard package")
except ImportError as error:
    assert "pip install 'unison[tensorboard]'" in str(error), error
assert unison.Accelerator(cpu=True, log_with="all").log_with == ["jsonl", "csv"]
print("[fresh env] trackers: jsonl and csv built in, tensorboard names its extra: ok")
PYCODE
"$workdir/venv/bin/unison" --help > /dev/null
"$workdir/venv/bin/unison" launch --help > /dev/null
echo "[fresh env] unison --help: ok"
"$workdir/venv/bin/unison" launch --nproc-per-node 2 --cpu "$checkout/examples/gpt/train.py" \
  --max-steps 5 --log-interval 1 --eval-interval 5 --eval-batches 1 --sample-chars 20 \
  --save-every 5 --project-dir "$workdir/run" > "$workdir/example.log" 2>&1 \
  || { cat "$workdir/example.log"; echo "[fresh env] FAILED: the GPT example on 2 processes"; exit 1; }
grep -Eq "step +5/5 \| val loss" "$workdir/example.log" \
  || { cat "$workdir/example.log"; echo "[fresh env] FAILED: the example did not reach step 5"; exit 1; }
echo "[fresh env] GPT example, 2 processes, 5 steps: ok ($((SECONDS - started)) s in all)"
# `unison plot` without matplotlib (the plot extra): an error that names the extra, not a traceback.
if "$workdir/venv/bin/unison" plot "$workdir/run" > "$workdir/plot.log" 2>&1; then
  cat "$workdir/plot.log"; echo "[fresh env] FAILED: unison plot ran without matplotlib"; exit 1
fi
grep -q "pip install 'unison\[plot\]'" "$workdir/plot.log" \
  || { cat "$workdir/plot.log"; echo "[fresh env] FAILED: unison plot did not name its extra"; exit 1; }
echo "[fresh env] unison plot without matplotlib names the extra: ok"
# The plot command the example printed, run as printed: it installs the plot extra first, then draws.
plot_command="$(sed -n 's/.*plot them: //p' "$workdir/example.log")"
began=$SECONDS
(cd "$checkout" && PATH="$workdir/venv/bin:$PATH" bash -c "$plot_command" > "$workdir/plot.log" 2>&1) \
  && grep -q "wrote $workdir/run/loss.png" "$workdir/plot.log" \
  || { cat "$workdir/plot.log"; echo "[fresh env] FAILED: the example's printed plot command: $plot_command"; exit 1; }
echo "[fresh env] the example's printed plot command installs the plot extra and draws: ok ($((SECONDS - began)) s)"
# unison.toml is read with the standard library (no extra); writing one needs tomli-w (the config extra).
mkdir "$workdir/project" && printf 'mixed_precision = "bf16"\n' > "$workdir/project/unison.toml"
(cd "$workdir/project" && "$workdir/venv/bin/unison" env > "$workdir/env.log" 2>&1) \
  || { cat "$workdir/env.log"; echo "[fresh env] FAILED: unison env with a unison.toml"; exit 1; }
grep -q "mixed_precision = bf16 (from unison.toml)" "$workdir/env.log" \
  || { cat "$workdir/env.log"; echo "[fresh env] FAILED: unison env did not show the file's setting"; exit 1; }
if "$workdir/venv/bin/unison" config --non-interactive --output "$workdir/new.toml" > "$workdir/config.log" 2>&1; then
  cat "$workdir/config.log"; echo "[fresh env] FAILED: unison config wrote TOML without tomli-w"; exit 1
fi
grep -q "unison\[config\]" "$workdir/config.log" \
  || { cat "$workdir/config.log"; echo "[fresh env] FAILED: unison config did not name its extra"; exit 1; }
echo "[fresh env] unison.toml read without extras, unison config names its extra: ok"
# the planner's cost model needs nothing beyond torch
"$workdir/venv/bin/unison" plan "$checkout/examples/gpt/model.py:gpt2_124m" --devices 8 --device a100-40gb \
  --seq-len 1024 --global-batch-size 480 > "$workdir/plan.log" 2>&1 \
  && grep -q "predicted step" "$workdir/plan.log" \
  || { cat "$workdir/plan.log"; echo "[fresh env] FAILED: unison plan with --global-batch-size"; exit 1; }
echo "[fresh env] unison plan prices a step: ok"
