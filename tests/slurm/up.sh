#!/usr/bin/env bash
# Bring up a single-node SLURM cluster on localhost (Debian 12 packages, no systemd).
#
# The node has the machine's real CPUs and (a bit less than) its real memory, plus one fake GPU of
# model `testgpu` (gres.conf `Type=testgpu File=/dev/null`) so that `--gpus=1` jobs are scheduled
# one at a time and `--gpus=testgpu:1` (a profile's `gpu_model`) can be told from another model.
# Two partitions over the same node, `cpu` (default) and `gpu`, mirror the names used in
# workflow/profiles/slurm/config.yaml. No accounting: status comes from squeue (MinJobAge=3600),
# per-job start/end times from the jobcomp/filetxt log.
#
# Idempotent: when the daemons already run with the same config it only waits for the node.
# Needs root. Env: SLURM_UP_SKIP_INSTALL=1 to never call apt-get.
# Prints the paths of the logs on stdout as KEY=VALUE lines at the end.
set -euo pipefail

LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
CONF=/etc/slurm/slurm.conf          # must be here: the job-step plugin clears SLURM_CONF
JOBCOMP_LOG=$LOG_DIR/jobcomp.log

die() {
    echo "up.sh: $*" >&2
    for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
        if [[ -f $f ]]; then
            echo "---- last lines of $f ----" >&2
            tail -n 30 "$f" >&2
        fi
    done
    command -v sinfo >/dev/null && { timeout 5 sinfo -N -l >&2 || true; }
    exit 1
}

[[ $(id -u) -eq 0 ]] || { echo "up.sh: must run as root" >&2; exit 2; }

# --- packages -------------------------------------------------------------------------------
pkgs=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    [[ ${SLURM_UP_SKIP_INSTALL:-0} == 1 ]] && { echo "up.sh: missing packages: ${missing[*]}" >&2; exit 3; }
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || { echo "up.sh: apt-get update failed" >&2; exit 3; }
    apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null \
        || { echo "up.sh: apt-get install failed" >&2; exit 3; }
fi

# --- pid helpers: only ever signal the process named in our own PID files --------------------
pid_alive() {  # pidfile expected-comm
    local pidfile=$1 comm=$2 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ $pid =~ ^[0-9]+$ ]] && [[ -r /proc/$pid/comm ]] && [[ $(</proc/$pid/comm) == "$comm" ]]
}

# --- munge: own key, socket dir with mode 755 ----------------------------------------------
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
fi
if ! pid_alive /run/munge/munged.pid munged; then
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2*
    runuser -u munge -- /usr/sbin/munged || die "munged did not start"
fi
for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n </dev/null | unmunge >/dev/null || die "munge round trip failed"

# --- slurm config ---------------------------------------------------------------------------
host=$(hostname -s)
# what slurmd itself detects, so the node is never "invalid" (more CPUs/memory than it has)
hw=$(slurmd -C | head -n1)
cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
mem_mb=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
[[ -n $cpus && -n $mem_mb ]] || die "cannot read CPUs/RealMemory from 'slurmd -C': $hw"
real_mem=$((mem_mb * 90 / 100))     # a bit below: slurmd rounds and the OS takes its share

install -d -m 0755 /etc/slurm "$RUN_DIR" "$LOG_DIR" /var/lib/slurm
install -d -m 0755 /var/lib/slurm/slurmctld /var/lib/slurm/slurmd

new_conf=$(mktemp)
trap 'rm -f "$new_conf"' EXIT
cat >"$new_conf" <<EOF
# Written by tests/slurm/up.sh: a one-node test cluster. Not for production.
ClusterName=hybridllama
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
# schedule often: the test DAG is many short jobs
SchedulerParameters=bf_interval=1,sched_min_interval=200000
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$JOBCOMP_LOG
# squeue must still see finished jobs when the executor plugin polls (it needs >= 3x its interval),
# and the test reads every job's GPU request with scontrol after the whole DAG has run
MinJobAge=3600
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$real_mem Gres=gpu:testgpu:1 State=UNKNOWN
PartitionName=cpu Nodes=$host Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$host MaxTime=INFINITE State=UP
EOF
gres_conf="NodeName=$host Name=gpu Type=testgpu Count=1 File=/dev/null"

changed=0
cmp -s "$new_conf" "$CONF" || changed=1
[[ $(cat /etc/slurm/gres.conf 2>/dev/null) == "$gres_conf" ]] || changed=1
if ((changed)); then
    # a running cluster with another config is stopped first (by PID file)
    if pid_alive "$RUN_DIR/slurmctld.pid" slurmctld || pid_alive "$RUN_DIR/slurmd.pid" slurmd; then
        "$(dirname "$0")/down.sh" --keep-munge
    fi
    install -m 0644 "$new_conf" "$CONF"
    echo "$gres_conf" >/etc/slurm/gres.conf
    chmod 0644 /etc/slurm/gres.conf
fi

# --- daemons --------------------------------------------------------------------------------
if ! pid_alive "$RUN_DIR/slurmctld.pid" slurmctld; then
    rm -f "$RUN_DIR/slurmctld.pid"
    # -c: start clean; a stale job state from an earlier container would only confuse the tests
    slurmctld -c || die "slurmctld did not start"
fi
if ! pid_alive "$RUN_DIR/slurmd.pid" slurmd; then
    rm -f "$RUN_DIR/slurmd.pid"
    slurmd || die "slurmd did not start"
fi

# --- wait for the node to accept jobs ------------------------------------------------------
state=""
for i in $(seq 150); do
    # a daemon that dies soon after forking (bad config) is only visible here; the PID file
    # appears a moment after the fork, so allow the first second
    if ((i > 5)); then
        pid_alive "$RUN_DIR/slurmctld.pid" slurmctld || die "slurmctld exited"
        pid_alive "$RUN_DIR/slurmd.pid" slurmd || die "slurmd exited"
    fi
    state=$(timeout 5 sinfo -h -N -n "$host" -o '%T' 2>/dev/null | head -n1 || true)
    case $state in
        idle | mixed | allocated) break ;;
        down* | drain* | fail*) scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
done
case $state in
    idle | mixed | allocated) ;;
    *) die "node $host not ready (state '$state')" ;;
esac

echo "SLURM_UP_HOST=$host"
echo "SLURM_UP_CTLD_LOG=$LOG_DIR/slurmctld.log"
echo "SLURM_UP_SLURMD_LOG=$LOG_DIR/slurmd.log"
echo "SLURM_UP_JOBCOMP_LOG=$JOBCOMP_LOG"
