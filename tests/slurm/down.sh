#!/usr/bin/env bash
# Stop the test cluster started by tests/slurm/up.sh.
# Daemons are stopped through their PID files only (the PID must still name the expected
# program), never by process name. Safe to run when nothing is up.
# --keep-munge: leave munged running (up.sh uses this when it only rewrites the config).
set -uo pipefail

RUN_DIR=/run/slurm
keep_munge=0
[[ ${1:-} == --keep-munge ]] && keep_munge=1

pid_of() {  # pidfile expected-comm -> prints the pid if it is alive and is that program
    local pidfile=$1 comm=$2 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ $pid =~ ^[0-9]+$ ]] && [[ -r /proc/$pid/comm ]] && [[ $(</proc/$pid/comm) == "$comm" ]] || return 1
    echo "$pid"
}

stop() {  # pidfile expected-comm
    local pidfile=$1 comm=$2 pid
    if pid=$(pid_of "$pidfile" "$comm"); then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 100); do
            [[ -d /proc/$pid ]] || break
            sleep 0.1
        done
        if [[ -d /proc/$pid ]]; then
            echo "down.sh: $comm ($pid) ignored SIGTERM, sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null
        fi
    fi
    rm -f "$pidfile"
}

# Cancel whatever is still queued or running, so no job outlives the cluster.
if pid_of "$RUN_DIR/slurmctld.pid" slurmctld >/dev/null; then
    ids=$(squeue -h -o '%i' 2>/dev/null || true)
    if [[ -n $ids ]]; then
        # shellcheck disable=SC2086
        scancel $ids 2>/dev/null || true
        for _ in $(seq 50); do
            [[ -z $(squeue -h -t RUNNING,COMPLETING -o '%i' 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
fi

stop "$RUN_DIR/slurmd.pid" slurmd
stop "$RUN_DIR/slurmctld.pid" slurmctld
((keep_munge)) || stop /run/munge/munged.pid munged
exit 0
