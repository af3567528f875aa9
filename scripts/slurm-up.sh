#!/usr/bin/env bash
# A real one-node Slurm on this machine, for the tests marked `slurm` (and for trying fastpar.jobs on Slurm):
# installs Debian's slurmctld, slurmd, slurm-client and munge when missing, writes a munge key and a
# slurm.conf naming this host with its cores and memory (no accounting: sacct has nothing to read), starts
# munged, slurmctld and slurmd, and waits until `sinfo` shows the node idle. Needs root. Run it again at any
# time: it installs, writes and starts only what is missing, and answers at once when the node is already up.
set -euo pipefail
[ "$(id -u)" -eq 0 ] || { echo "slurm-up: needs root (apt-get, /etc/slurm, daemons)" >&2; exit 2; }

host=$(hostname -s)
conf=/etc/slurm/slurm.conf
say() { echo "slurm-up: $*"; }

node_state() { timeout 5 sinfo -h -N -n "$host" -o '%t' 2>/dev/null | head -1 | tr -d '*~#!%$@^-'; }
if command -v sinfo >/dev/null && [ -f "$conf" ] && grep -q "^NodeName=$host " "$conf" \
   && [ "$(node_state)" = idle ]; then
    say "node $host is already idle"; exit 0
fi

missing=()
for tool in slurmctld slurmd sinfo munged; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # no init system in containers: keep the packages' scripts from starting services themselves
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
    rm -f /usr/sbin/policy-rc.d
fi

# munge: one key, readable by the munge user only
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- munged --force
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# slurm.conf: this host, its CPUs and memory as slurmd sees them; cores and memory are what jobs ask for
node_line=$(slurmd -C | head -1)                               # NodeName=host CPUs=.. ... RealMemory=..
cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$node_line")
memory=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
memory=$((memory * 95 / 100))                                   # leave the OS some room
node_line=$(sed "s/RealMemory=[0-9]*/RealMemory=$memory/" <<<"$node_line")
install -d /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > "$conf.new" <<CONF
# written by fastpar's scripts/slurm-up.sh: a one-node cluster on $host
ClusterName=fastpar
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# no cgroup hierarchy to rely on in containers: track processes by parentage, bind with sched_setaffinity
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$((memory / cpus))
SchedulerType=sched/backfill
ReturnToService=2
# accounting off: sacct fails, fastpar reads job states from squeue/scontrol
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# time limits are checked every few seconds, and a job over its limit is killed soon after
InactiveLimit=0
KillWait=5
OverTimeLimit=0
MinJobAge=300
$node_line State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
restart=0
if ! cmp -s "$conf.new" "$conf"; then mv "$conf.new" "$conf"; restart=1; else rm "$conf.new"; fi

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
for daemon in slurmctld slurmd; do
    if [ "$restart" = 1 ] && pid_alive "/run/$daemon.pid"; then kill "$(cat "/run/$daemon.pid")"; sleep 1; fi
    if ! pid_alive "/run/$daemon.pid"; then
        if [ "$daemon" = slurmctld ]; then slurmctld -c; else slurmd; fi
    fi
done

for _ in $(seq 60); do
    state=$(node_state || true)
    if [ "$state" = idle ]; then say "node $host idle ($cpus CPUs, ${memory} MB)"; exit 0; fi
    if [ "$state" = down ] || [ "$state" = drain ]; then scontrol update nodename="$host" state=resume 2>/dev/null || true; fi
    sleep 1
done
echo "slurm-up: node $host did not become idle within 60 s (state: ${state:-none}); see /var/log/slurm/" >&2
tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
exit 1
