#!/usr/bin/env bash
# Command 2: install what is missing (library and test tools), then run the whole test suite and, beside
# it, prove the library works in a fresh environment with only its declared dependencies
# (scripts/check_fresh_env.sh, about a minute and a half).
#
# The suite runs in three parts. Most tests run on UNISON_TEST_WORKERS pytest-xdist workers (default 2,
# one per core of our CI machines), whole files to a worker (--dist loadfile: a file's launches and
# module fixtures stay together), while the real launchers are installed (scripts/install_launchers.sh:
# SLURM, Open MPI, MPICH from Debian's packages). Then the tests marked `serial`, which assert how many
# seconds something takes (a crash ended, a hang reported), run alone; then those marked `cluster`:
# under the real srun, sbatch, mpirun and mpiexec on a one-host SLURM cluster of their own
# (tests/test_real_launchers.py, 1-2 minutes), and three nodes in network namespaces, one losing its
# link (tests/test_three_nodes.py, about a minute), while the fresh environment is built beside them:
# they wait on daemons and timeouts more than they compute, where the parallel part keeps both cores busy.
# Each test's and each launch's time limit is scaled by how busy the machine is when a part starts
# (tests/slowness.py: a workload timed against the idle machine's 0.25 s; UNISON_TEST_SLOWNESS=F sets the
# factor): a busy machine gives a slower run, not timeouts. The seconds the serial tests assert are not scaled.
# The parallel part lists its 30 slowest tests (--durations), where the suite's 20-minute budget goes.
# Extra arguments go to pytest (both parts); UNISON_SKIP_FRESH_ENV=1 skips the fresh environment for a
# quick local re-run (CI never sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
bash scripts/install.sh test

fresh_pid=""
fresh_log="$(mktemp -t unison-fresh-env-XXXXXX.log)"
launchers_log="$(mktemp -t unison-launchers-XXXXXX.log)"
trap 'rm -f "$fresh_log" "$launchers_log"; [ -z "$fresh_pid" ] || kill "$fresh_pid" 2>/dev/null || true' EXIT
bash scripts/install_launchers.sh > "$launchers_log" 2>&1 &
launchers_pid=$!

# pytest exits 5 when a part selects no test (e.g. arguments that name only serial tests): not a failure.
run_part() { "$PY" -m pytest "$@" || { status=$?; [ "$status" -eq 5 ] || return "$status"; }; }

parallel=0
run_part -n "${UNISON_TEST_WORKERS:-2}" --dist loadfile --durations=30 -m "not serial and not cluster" "$@" || parallel=$?
serial=0
run_part -m "serial and not cluster" "$@" || serial=$?
launchers=0
wait "$launchers_pid" || launchers=$?
cat "$launchers_log"
[ "$launchers" -eq 0 ] || echo "[launchers] FAILED to install (exit $launchers): see the lines above"
if [ "${UNISON_SKIP_FRESH_ENV:-0}" != "1" ]; then
  bash scripts/check_fresh_env.sh > "$fresh_log" 2>&1 &
  fresh_pid=$!
fi
cluster=0
run_part -m cluster "$@" || cluster=$?
fresh=0
if [ -n "$fresh_pid" ]; then
  wait "$fresh_pid" || fresh=$?
  fresh_pid=""
  cat "$fresh_log"
  [ "$fresh" -eq 0 ] || echo "[fresh env] FAILED (exit $fresh): see the lines above"
fi
[ "$parallel" -eq 0 ] && [ "$fresh" -eq 0 ] && [ "$serial" -eq 0 ] && [ "$launchers" -eq 0 ] && [ "$cluster" -eq 0 ]
