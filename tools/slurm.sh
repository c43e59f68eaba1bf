#!/usr/bin/env bash
# A one-node Slurm on this machine, so tests/test_slurm_launch.py can start ranks with a real srun
# (shmcoll.init() reading SLURM_* variables) instead of faking them. Needs root and the Debian
# packages slurm-wlm and munge (Debian 12: Slurm 22.05, config in /etc/slurm/slurm.conf).
#
#   tools/slurm.sh start   munge key (if missing), munged, slurm.conf, slurmctld, slurmd; returns once
#                          sinfo shows the node idle and `srun -n 1 true` runs (fails after a deadline)
#   tools/slurm.sh stop    stops slurmd, slurmctld, and munged if this script started it
#
# Idempotent: start with the daemons up only re-checks them. The config is the smallest that runs
# here: no cgroups (proctrack/linuxproc, task/none: containers rarely have a usable cgroup tree),
# root as SlurmUser, ReturnToService=2 so a node left DOWN by an earlier run comes back when its
# slurmd registers. The node's address is pinned to 127.0.0.1, so Slurm itself works even where the
# hostname does not resolve (shmcoll's rendezvous, derived from the node list, still needs it to).
# Every wait has a deadline (SLURM_SH_DEADLINE seconds, default 60).
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"   # the daemons live there; a non-login root shell may lack it

CONF=/etc/slurm/slurm.conf
STATE=/run/shmcoll-slurm            # pid files and the "we started munged" mark
SPOOL=/var/spool/shmcoll-slurm      # slurmctld state and slurmd spool
LOG=/var/log/shmcoll-slurm
DEADLINE=${SLURM_SH_DEADLINE:-60}
NODE=$(hostname -s)
HOSTS_MARK="# shmcoll-slurm"            # the /etc/hosts line start adds when the node's name does not resolve

die() { echo "slurm.sh: $*" >&2; for f in "$LOG"/*.log; do [ -f "$f" ] && tail -n 20 "$f" >&2; done; exit 1; }
# the process in pid file $1 runs and is not a zombie (killed daemons can linger as zombies here)
alive() { local pid; pid=$(cat "$1" 2>/dev/null) && [ -n "$(awk '$3 != "Z"' "/proc/$pid/stat" 2>/dev/null)" ]; }

# until CMD... succeeds, or die after DEADLINE seconds saying WHAT did not happen
wait_for() {
  local what=$1 end=$((SECONDS + DEADLINE)); shift
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$end" ] || die "gave up after ${DEADLINE}s waiting for $what"
    sleep 0.5
  done
}

node_idle() { [ "$(timeout 10 sinfo -h -n "$NODE" -o %t)" = idle ]; }
munge_ok() { timeout 10 munge -n </dev/null 2>/dev/null | timeout 10 unmunge >/dev/null 2>&1; }

write_conf() {
  mkdir -p /etc/slurm "$STATE" "$SPOOL/ctld" "$SPOOL/d" "$LOG"
  cat >"$CONF.tmp" <<EOF
# written by shmcoll's tools/slurm.sh: a one-node test cluster
ClusterName=shmcoll
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=test Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
}

start() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null || die "install slurm-wlm and munge"
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  # munged refuses a key or directories that others can read or write
  chown -R munge:munge /etc/munge && chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge && chmod 755 /run/munge
  if ! munge_ok; then
    mkdir -p "$STATE" && runuser -u munge -- munged && touch "$STATE/munged.ours"
    wait_for "munged to answer" munge_ok
  fi
  if ! getent hosts "$NODE" >/dev/null; then  # ranks meet at the node's name: it must resolve
    mkdir -p "$STATE" && echo "127.0.0.1 $NODE $HOSTS_MARK" >>/etc/hosts && touch "$STATE/hosts.ours"
  fi
  alive "$STATE/slurmctld.pid" && alive "$STATE/slurmd.pid" && [ -f "$CONF" ] || {
    stop_slurm
    write_conf
    slurmctld -c                    # -c: no state from an earlier run (its jobs, a DOWN node)
    wait_for "slurmctld to answer" timeout 10 scontrol ping
    slurmd
  }
  wait_for "node $NODE to be idle in sinfo" node_idle
  wait_for "srun -n 1 true to run" timeout 30 srun -n 1 true
}

stop_pid() {
  local pidfile=$1 end=$((SECONDS + DEADLINE))
  alive "$pidfile" || { rm -f "$pidfile"; return 0; }
  local pid; pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  while alive "$pidfile"; do
    if [ "$SECONDS" -ge "$end" ]; then kill -9 "$pid" 2>/dev/null || true; break; fi
    sleep 0.2
  done
  rm -f "$pidfile"
}

stop_slurm() { stop_pid "$STATE/slurmd.pid"; stop_pid "$STATE/slurmctld.pid"; }

stop() {
  stop_slurm
  if [ -f "$STATE/munged.ours" ]; then
    stop_pid /run/munge/munged.pid
    rm -f "$STATE/munged.ours"
  fi
  if [ -f "$STATE/hosts.ours" ]; then  # in place: /etc/hosts is often a bind mount
    local kept; kept=$(grep -vF "$HOSTS_MARK" /etc/hosts || true)
    printf '%s\n' "$kept" >/etc/hosts
    rm -f "$STATE/hosts.ours"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
