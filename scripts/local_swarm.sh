#!/usr/bin/env bash
# A whole swarm on one machine: one DHT bootstrap node and N training workers, on 127.0.0.1, in a
# closed run: only workers started with the run's secret take part (docs/trust.md).
#
#   scripts/local_swarm.sh [-n WORKERS] [options] [-- more `opendiloco train` options]
#
#   scripts/local_swarm.sh -n 2                                   # configs/tiny.toml, 2 workers
#   scripts/local_swarm.sh -n 4 --config configs/150m.toml -- --train.device cpu
#
# Options:
#   -n, --workers N     number of workers (default 2)
#   --config FILE       training config (default configs/tiny.toml)
#   --run-dir DIR       everything goes here (default runs/local_swarm): bootstrap.addrs,
#                       logs/<name>.log, and one run dir per worker (worker-<i>/: checkpoints,
#                       metrics.jsonl); rerunning with the same dir resumes the workers
#   --run-id ID         swarm run id (default local)
#   --listen-ip IP      address everything listens on (default 127.0.0.1; 0.0.0.0 lets other
#                       machines join too, with --bootstrap-port)
#   --bootstrap-port P  fixed port for the bootstrap (default 0: any free port)
#   --secret-file FILE  the run secret every worker is started with (default: $OPENDILOCO_RUN_SECRET or
#                       $OPENDILOCO_RUN_SECRET_FILE if set, else <run dir>/run.secret, made by `opendiloco
#                       secret` on the first start: 256 random bits, mode 600, kept for the next start).
#                       A worker on another machine joins with a copy of the same file
#   --open-run          no secret: an open run, which anyone who can reach a worker can join, vote on the
#                       run's state, serve state to joiners, download the model and stall rounds
#
# Ctrl-C (or SIGTERM) stops exactly the processes this script started: the workers first (they
# write a checkpoint and leave), then the bootstrap; anything still alive after a grace period
# is killed, by PID. Each worker's DHT process and p2p daemon exit with their worker.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "local_swarm.sh: $*" >&2; exit 2; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
workers=2 config="$root/configs/tiny.toml" run_dir=runs/local_swarm run_id=local
listen_ip=127.0.0.1 bootstrap_port=0 secret_file="" open_run=0
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        -n|--workers) workers=${2:?$1 needs a value}; shift 2 ;;
        --config) config=${2:?--config needs a value}; shift 2 ;;
        --run-dir) run_dir=${2:?--run-dir needs a value}; shift 2 ;;
        --run-id) run_id=${2:?--run-id needs a value}; shift 2 ;;
        --listen-ip) listen_ip=${2:?--listen-ip needs a value}; shift 2 ;;
        --bootstrap-port) bootstrap_port=${2:?--bootstrap-port needs a value}; shift 2 ;;
        --secret-file) secret_file=${2:?--secret-file needs a value}; shift 2 ;;
        --open-run) open_run=1; shift ;;
        --) shift; break ;;
        *) die "unknown option: $1 (see --help)" ;;
    esac
done
case "$workers" in ''|*[!0-9]*|0) die "--workers must be a positive number, got '$workers'" ;; esac
[ -f "$config" ] || die "config $config not found"
if [ "$open_run" = 1 ]; then
    [ -z "$secret_file" ] || die "--open-run and --secret-file: a run is either open or closed by its secret"
    for v in OPENDILOCO_RUN_SECRET OPENDILOCO_RUN_SECRET_FILE; do
        [ -z "${!v:-}" ] || die "--open-run, but \$$v is set (a closed run's secret): unset it, or drop --open-run"
    done
elif [ -z "$secret_file" ] && [ -z "${OPENDILOCO_RUN_SECRET:-}" ]; then
    secret_file=${OPENDILOCO_RUN_SECRET_FILE:-}
fi
# $secret_file empty now: an open run, $OPENDILOCO_RUN_SECRET, or a new secret in the run dir (below).
if [ -n "$secret_file" ]; then
    [ -f "$secret_file" ] && [ -r "$secret_file" ] || die "run secret $secret_file is not a readable file"
fi

if command -v opendiloco >/dev/null 2>&1; then
    opendiloco=(opendiloco)
elif [ -x "$root/.venv/bin/opendiloco" ]; then
    opendiloco=("$root/.venv/bin/opendiloco")
else
    die "opendiloco is not installed (run scripts/setup.sh)"
fi

mkdir -p "$run_dir/logs"
addrs_file="$run_dir/bootstrap.addrs"
rm -f "$addrs_file"

# The run secret (closed by default), or an open run chosen with --open-run.
train_args=()
if [ "$open_run" = 1 ]; then
    train_args=(--swarm.open)
    echo "an OPEN run (--open-run): anyone who can reach a worker can join it, vote on the run's state, serve" \
        "state to joiners, download the model and stall rounds"
elif [ -z "$secret_file" ] && [ -n "${OPENDILOCO_RUN_SECRET:-}" ]; then
    echo "run secret: \$OPENDILOCO_RUN_SECRET (a closed run)"
else
    if [ -z "$secret_file" ]; then
        secret_file=$run_dir/run.secret
        if [ ! -e "$secret_file" ]; then
            out=$("${opendiloco[@]}" secret "$secret_file" 2>&1) || die "$out"
        fi
        [ -f "$secret_file" ] && [ -r "$secret_file" ] || die "run secret $secret_file is not a readable file"
    fi
    echo "run secret: $secret_file (a closed run: only workers started with it take part)"
fi

pids=() names=()
stopping=0

alive() { kill -0 "$1" 2>/dev/null; }

stop_all() {
    # Workers first (SIGTERM: they checkpoint and leave), then the bootstrap; by PID only.
    [ "$stopping" = 0 ] || return 0
    stopping=1
    trap - INT TERM
    local i pid deadline members
    for group in workers bootstrap; do
        members=()  # the PIDs of this group: only they are signalled, and only they are waited for
        for i in "${!pids[@]}"; do
            if { [ "$group" = workers ] && [ "${names[$i]}" != bootstrap ]; } ||
               { [ "$group" = bootstrap ] && [ "${names[$i]}" = bootstrap ]; }; then
                members+=("${pids[$i]}")
            fi
        done
        for pid in "${members[@]}"; do
            alive "$pid" && kill -TERM "$pid" 2>/dev/null || true
        done
        deadline=$((SECONDS + 30))
        for pid in "${members[@]}"; do
            while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
        done
    done
    for i in "${!pids[@]}"; do
        pid=${pids[$i]}
        if alive "$pid"; then
            echo "local_swarm.sh: ${names[$i]} (pid $pid) did not stop; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
}

on_signal() {
    echo "local_swarm.sh: stopping ${#pids[@]} process(es): ${pids[*]}" >&2
    stop_all
    exit 130
}
trap on_signal INT TERM
trap stop_all EXIT

start() {  # start NAME ARGS...: runs ARGS in the background, logging to logs/NAME.log
    local name=$1; shift
    "$@" >"$run_dir/logs/$name.log" 2>&1 &
    pids+=($!) names+=("$name")
    echo "started $name (pid $!): log $run_dir/logs/$name.log"
}

start bootstrap "${opendiloco[@]}" dht --host-maddrs "/ip4/$listen_ip/tcp/$bootstrap_port" --addrs-file "$addrs_file"
deadline=$((SECONDS + 60))
until [ -s "$addrs_file" ]; do
    alive "${pids[0]}" || { cat "$run_dir/logs/bootstrap.log" >&2; die "the bootstrap exited"; }
    [ "$SECONDS" -lt "$deadline" ] || die "the bootstrap wrote no address within 60s (see $run_dir/logs/bootstrap.log)"
    sleep 0.2
done
mapfile -t peers < "$addrs_file"
echo "bootstrap: ${peers[*]}"

# The workers' secret (the bootstrap needs none: it stores signed records and cannot read a closed run's).
if [ -n "$secret_file" ]; then
    unset OPENDILOCO_RUN_SECRET  # the file named here wins over a value in the environment
    export OPENDILOCO_RUN_SECRET_FILE=$secret_file
fi
for ((i = 0; i < workers; i++)); do
    resume=()
    [ ! -d "$run_dir/worker-$i" ] || resume=(--resume)
    start "worker-$i" "${opendiloco[@]}" train --config "$config" "${resume[@]}" \
        --swarm.initial-peers "${peers[@]}" --swarm.host-maddrs "/ip4/$listen_ip/tcp/0" \
        --swarm.run-id "$run_id" --run.worker "worker-$i" --run.dir "$run_dir/worker-$i" "${train_args[@]}" "$@"
done
echo "watch:  tail -f $run_dir/logs/worker-*.log"
status_secret=""
[ -z "$secret_file" ] || status_secret=" --swarm.secret-file $secret_file"
echo "status: ${opendiloco[*]} status$status_secret --swarm.initial-peers ${peers[0]} --swarm.run-id $run_id"
echo "live page: the same with --serve 8080, then open http://127.0.0.1:8080/"

status=0
for i in "${!pids[@]}"; do
    [ "${names[$i]}" != bootstrap ] || continue
    rc=0
    wait "${pids[$i]}" || rc=$?
    if [ "$rc" != 0 ]; then
        echo "local_swarm.sh: ${names[$i]} exited with status $rc (see $run_dir/logs/${names[$i]}.log)" >&2
        status=$rc
    fi
done
echo "all workers finished; stopping the bootstrap"
stop_all
exit "$status"
