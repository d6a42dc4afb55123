#!/usr/bin/env bash
# A one-host SLURM cluster for tests/test_real_launchers.py (and for trying srun/sbatch by hand):
#
#   eval "$(bash scripts/slurm_cluster.sh start DIR)"   # prints `export SLURM_CONF=DIR/slurm.conf`
#   srun -N1 -n2 python examples/gpt/train.py --cpu
#   bash scripts/slurm_cluster.sh stop DIR
#
# `start` writes DIR/slurm.conf for this host (CPUs from nproc, the node reached on 127.0.0.1, ports
# derived from DIR so two clusters on one machine do not collide), starts munged (unless one answers)
# and slurmctld and slurmd with that file, and waits until the node is idle. Everything they write
# (state, spool, logs, pid files) stays in DIR. `stop` ends the daemons it started and waits for them.
# Needs root and Debian's slurm-wlm and munge (scripts/install_launchers.sh installs them).
set -euo pipefail

action="${1:?usage: slurm_cluster.sh start|stop DIR}"
dir="$(mkdir -p "${2:?usage: slurm_cluster.sh start|stop DIR}" && cd "$2" && pwd)"
conf="$dir/slurm.conf"

stop() {
  for daemon in slurmd slurmctld munged; do
    pidfile="$dir/$daemon.pid"
    [ -f "$pidfile" ] || continue
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
  done
}

start() {
  local host cpus port
  host="$(hostname)"
  # nproc obeys OMP_NUM_THREADS (a test or a cluster profile setting 1 made a node of 1 CPU, where
  # `srun -n2` waits forever): count the cores this process may run on without it
  cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
  port=$((20000 + $(printf '%s' "$dir" | cksum | cut -d' ' -f1) % 20000))
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  cat > "$conf" <<EOF
# Written by scripts/slurm_cluster.sh: one node, this host, reached on loopback.
ClusterName=unison
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
# No cgroup hierarchy to delegate here: tasks are tracked by process tree and pinned to cores by affinity.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile /etc/munge/munge.key
    chown -R munge: /run/munge /var/log/munge /var/lib/munge /etc/munge
    munged --force --pid-file "$dir/munged.pid"
  fi
  slurmctld -f "$conf"
  slurmd -f "$conf"
  for _ in $(seq 100); do
    state="$(SLURM_CONF="$conf" sinfo --noheader --format=%t 2>/dev/null || true)"
    if [ "$state" = "idle" ]; then
      echo "export SLURM_CONF=$conf"
      return 0
    fi
    sleep 0.2
  done
  echo "slurm_cluster.sh: the node did not become idle in 20 s (state: '${state:-none}'); see $dir/log" >&2
  stop
  return 1
}

case "$action" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: slurm_cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
