#!/usr/bin/env bash
# Every GPU check of issue 30 in one run, for the first session that is lent a GPU (device time is short:
# one machine start, one command). Run from the repository root on a machine with one CUDA GPU:
#   bash benchmarks/gpu_session.sh OUT_DIR [SECONDS]   # SECONDS: the whole run's budget (default 540)
#   SMOKE=1 bash benchmarks/gpu_session.sh /tmp/out    # on a CPU: the plumbing, with every --smoke
#   ONLY='offload|meta' SKIP='eager' bash ...          # the parts whose names match ONLY and not SKIP
# Parts run in order of importance, each under its own time limit cut to what is left of the budget,
# so one that hangs or fails costs only itself. OUT_DIR gets session.log (everything printed) and the
# JSON each benchmark writes. The package is used from src/ (PYTHONPATH), not installed.
set -uo pipefail
out="${1:?give the folder for the logs and results}"
budget="${2:-540}"
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
smoke=${SMOKE:+--smoke}
start=$SECONDS
log="$out/session.log"

part() {  # part NAME LIMIT COMMAND...: run COMMAND under min(LIMIT, what is left), logged
  local name=$1 limit=$2
  shift 2
  if ! [[ $name =~ ${ONLY:-.} ]] || [[ -n ${SKIP:-} && $name =~ $SKIP ]]; then
    echo "=== $name: not asked for" | tee -a "$log"
    return
  fi
  local left=$((budget - (SECONDS - start) - 5))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    echo "=== $name: skipped, the budget is spent" | tee -a "$log"
    return
  fi
  echo "=== $name (limit ${limit} s, at $((SECONDS - start)) s)" | tee -a "$log"
  local begun=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - begun)) s" | tee -a "$log"
}

part environment 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import torch, sys; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
  \"nccl\", torch.cuda.nccl.version() if torch.cuda.is_available() else None); import unison; print(unison.__file__)"'
part "1 GPU tests" 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  "tests/test_fidelity.py::test_num_items_with_fp16_keeps_the_loss_scale_until_unscaling" \
  tests/test_planner.py::test_detect_hardware_reads_the_cuda_device \
  tests/test_accelerate_compat.py::test_availability_probes_answer_from_torch_and_the_installed_packages \
  tests/test_launch.py::test_env_report
part "2 GPT-2 124M, bf16, compiled: unison vs raw" 200 \
  python3 benchmarks/gpu_gpt.py $smoke --rounds 6 --out "$out/gpu_gpt_compiled.json"
part "5 watchdog on/off beside NCCL" 70 python3 benchmarks/gpu_watchdog.py $smoke --out "$out/gpu_watchdog.json"
part "3 activation checkpointing" 80 python3 benchmarks/gpu_memory.py activations $smoke --out "$out/gpu_memory.json"
part "3 find_executable_batch_size" 60 python3 benchmarks/gpu_memory.py batch $smoke --out "$out/gpu_memory.json"
if [ -n "$smoke" ]; then  # the CPU check: a tiny model, short sequences
  plan=(tests/workers/tiny_gpt.py:tiny_gpt_16 --global-batch-size 8 --seq-len 16 --cpu)
else
  plan=(examples/gpt/model.py:gpt2_124m --global-batch-size 32 --seq-len 1024)
fi
part "4 plan --measure" 90 python3 -m unison plan "${plan[@]}" --devices 1 --device h100 \
  --precision bf16-mixed --measure 3 --measure-steps 3
part "2 GPT-2 124M, bf16, eager: unison vs raw" 60 \
  python3 benchmarks/gpu_gpt.py $smoke --no-compile --rounds 6 --profile --out "$out/gpu_gpt_eager.json"
part "3 ZeRO-3 + offload vs on the device" 90 python3 benchmarks/gpu_memory.py offload $smoke --out "$out/gpu_memory.json"
part "3 ZeRO-2/3 + offload on one process: the suite's checks" 60 \
  python3 tests/workers/offload_one_process_worker.py "$out/offload_checks.json" ${smoke:---gpu}
part "3 meta init over half the device, ZeRO-3 + offload" 250 \
  python3 benchmarks/gpu_memory.py meta $smoke --meta-share 0.51 --out "$out/gpu_memory.json"
echo "=== done at $((SECONDS - start)) s" | tee -a "$log"
