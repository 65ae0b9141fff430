#!/usr/bin/env bash
# Install and start a single-machine SLURM (munge + slurmctld + slurmd) for tests and CI.
#
#   bash scripts/setup_slurm.sh            # Debian 12; as root; safe to re-run
#   bash scripts/setup_slurm.sh --stop     # stop the daemons this script started (exit 0 when none run)
#
# This host becomes the controller and NODES compute nodes (default 2), partition "debug". With
# NODES>1 the nodes are fake: one slurmd per node name on this host (`slurmd -N nodeK`, own port),
# which Debian's slurm allows (built with --enable-multiple-slurmd: `scontrol show config` says
# MULTIPLE_SLURMD = Yes); each claims all CPUs, so multi-node sbatch scripts really run here.
# The config is cgroup-free (proctrack/linuxproc, task/none): containers and CI VMs often have no
# cgroup hierarchy slurm may manage. Daemons are started directly (no systemd needed or used).
#
# Env: NODES (default 2; 1 = one node named like this host), SLURM_CONF (default
# /etc/slurm/slurm.conf), FORCE=1 to overwrite a slurm.conf this script did not write,
# WAIT_S (default 60) for the nodes to become idle, STARTED (default /run/megatron_rl_slurm.started): where
# the pid files of the daemons it starts are listed, for --stop (scripts/test.sh passes its own).
# It installs slurm-wlm and munge system-wide (apt-get) when missing; --stop leaves the packages.
set -euo pipefail

CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
NODES=${NODES:-2}
WAIT_S=${WAIT_S:-60}
MARK="# written by megatron_rl scripts/setup_slurm.sh"
LOG_DIR=/var/log/slurm
SPOOL=/var/spool/slurm
STARTED=${STARTED:-/run/megatron_rl_slurm.started}
log() { echo "[setup_slurm] $*"; }
die() { echo "[setup_slurm] ERROR: $*" >&2; exit 1; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }  # alive PIDFILE
stop_daemon() {  # stop_daemon PIDFILE - by the pid it recorded, never by name
  local pid
  alive "$1" || return 0
  pid=$(cat "$1")
  log "stopping pid $pid ($1)"
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  die "pid $pid ($1) did not stop within 10 s"
}

if [ "${1:-}" = --stop ]; then  # slurmds first, then the controller, then munged: the reverse of the start
  if [ ! -s "$STARTED" ]; then log "nothing to stop ($STARTED lists no daemon this script started)"; exit 0; fi
  tac "$STARTED" | while read -r pidfile; do stop_daemon "$pidfile"; done
  rm -f "$STARTED"
  log "stopped what it had started"
  exit 0
fi

[ "$(id -u)" = 0 ] || die "run as root (installs packages and starts daemons)"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "NODES=$NODES: expected a positive integer"

# --- 1. packages (apt-get only when something is missing, so re-runs are fast and offline-safe)
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null || ! command -v ip >/dev/null; then
  log "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # The packages' postinst cannot start services without systemd; we start them below.
  apt-get install -y -q --no-install-recommends slurm-wlm munge iproute2 procps
fi

# --- 2. munge: key + daemon (slurm authenticates every RPC through it)
if [ ! -s /etc/munge/munge.key ]; then
  log "creating munge key"
  install -d -o munge -g munge -m 0700 /etc/munge
  mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  echo /run/munge/munged.pid >> "$STARTED"  # Debian's munged writes its pid there
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# --- 3. slurm.conf from what slurmd detects on this machine
HOST=$(hostname -s)
if [ "$NODES" = 1 ]; then NODE_NAMES=("$HOST"); else mapfile -t NODE_NAMES < <(seq -f 'node%g' "$NODES"); fi
# `slurmd -C` prints "NodeName=<host> CPUs=.. Boards=.. SocketsPerBoard=.. CoresPerSocket=..
# ThreadsPerCore=.. RealMemory=..": exactly what slurmd will check itself against when it registers.
NODE_HW=$(slurmd -C | head -n1 | sed -e 's/^NodeName=[^ ]* //')
[ -n "$NODE_HW" ] || die "slurmd -C printed nothing"
node_lines=""
for i in "${!NODE_NAMES[@]}"; do
  node_lines+="NodeName=${NODE_NAMES[$i]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((6818 + i)) $NODE_HW State=UNKNOWN"$'\n'
done
new_conf="$MARK
ClusterName=megatronrl
# 127.0.0.1: works whether or not this host's name resolves.
SlurmctldHost=$HOST(127.0.0.1)
# root: a throw-away test cluster; avoids spool/log ownership issues with a \"slurm\" user.
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
# cgroup-free: containers and CI VMs often have no cgroup hierarchy slurm may manage.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
# CPUs only: memory is not a consumable, so tests need not size --mem.
SelectTypeParameters=CR_CPU
# A node that was down (daemon restart) comes back by itself.
ReturnToService=2
# Short waits keep test jobs and cancellations quick.
KillWait=10
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=60
StateSaveLocation=$SPOOL/ctld
# %n = node name: a spool dir, pid file and log per slurmd.
SlurmdSpoolDir=$SPOOL/d-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
${node_lines}PartitionName=debug Nodes=$(IFS=,; echo "${NODE_NAMES[*]}") Default=YES MaxTime=INFINITE State=UP"
changed=0
if [ -f "$CONF" ] && ! grep -qxF "$MARK" "$CONF" && [ "${FORCE:-0}" != 1 ]; then
  die "$CONF exists and was not written by this script; refusing to replace it (FORCE=1 to overwrite)"
fi
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$new_conf" ]; then
  log "writing $CONF (nodes: ${NODE_NAMES[*]})"
  install -d "$(dirname "$CONF")"
  printf '%s\n' "$new_conf" > "$CONF"
  changed=1
fi
install -d -m 0755 "$LOG_DIR" "$SPOOL/ctld"

# --- 4. daemons: restart all on a config change, start those not running
start_daemon() {  # start_daemon PIDFILE LOGFILE COMMAND...
  local pidfile=$1 logfile=$2
  shift 2
  alive "$pidfile" && return 0
  log "starting $*"
  SLURM_CONF=$CONF "$@"  # daemonizes itself
  echo "$pidfile" >> "$STARTED"
  for _ in $(seq 100); do alive "$pidfile" && return 0; sleep 0.1; done
  tail -n 20 "$logfile" >&2 || true
  die "'$*' did not start (log: $logfile)"
}
if [ "$changed" = 1 ]; then
  for f in /run/slurmd*.pid; do [ -e "$f" ] && stop_daemon "$f"; done
  stop_daemon /run/slurmctld.pid
fi
start_daemon /run/slurmctld.pid "$LOG_DIR/slurmctld.log" /usr/sbin/slurmctld
for n in "${NODE_NAMES[@]}"; do
  install -d -m 0755 "$SPOOL/d-$n"
  start_daemon "/run/slurmd-$n.pid" "$LOG_DIR/slurmd-$n.log" /usr/sbin/slurmd -N "$n"
done

# --- 5. wait until every node takes jobs
export SLURM_CONF=$CONF
deadline=$((SECONDS + WAIT_S))
states=""
while [ $SECONDS -lt $deadline ]; do
  states=$(sinfo -h -N -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
  ready=1
  for n in "${NODE_NAMES[@]}"; do
    case " $states" in
      *" $n=idle "* | *" $n=mix "* | *" $n=alloc "*) ;;
      # Left over from an earlier config or a killed slurmd: put it back in service.
      *" $n=down"* | *" $n=drain"* | *" $n=drng"*)
        ready=0; scontrol update NodeName="$n" State=RESUME 2>/dev/null || true ;;
      *) ready=0 ;;
    esac
  done
  if [ $ready = 1 ]; then log "ready: ${states}(partition debug, $(nproc) CPUs per node)"; exit 0; fi
  sleep 1
done
scontrol show node >&2 || true
tail -n 20 "$LOG_DIR"/slurm*.log >&2 || true
die "nodes not idle after ${WAIT_S}s (states: '${states:-no answer from slurmctld}')"
