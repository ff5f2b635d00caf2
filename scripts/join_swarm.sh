#!/usr/bin/env bash
# Join a running OpenDiLoCo swarm as one training worker. A run is closed by its secret: the worker
# needs the run's secret file (made once with `opendiloco secret FILE`, copied to every worker), or
# an explicit --open-run.
#
#   scripts/join_swarm.sh [options] PEER_MADDR... [-- more `opendiloco train` options]
#   scripts/join_swarm.sh --peers-file FILE [options] [-- ...]
#
# Examples:
#   # a worker with a public IP, port 31337 open:
#   scripts/join_swarm.sh --secret-file run.secret --port 31337 --public-ip 203.0.113.7 \
#       /ip4/198.51.100.1/tcp/31337/p2p/12D3KooW...
#   # behind NAT (outbound connections only), the secret named in the environment:
#   OPENDILOCO_RUN_SECRET_FILE=run.secret scripts/join_swarm.sh --client-mode \
#       /ip4/198.51.100.1/tcp/31337/p2p/12D3KooW...
#   # the address published by a bootstrap (`opendiloco dht --addrs-file FILE`), waiting for it:
#   scripts/join_swarm.sh --secret-file /run/secrets/run_secret --peers-file /data/swarm/bootstrap.addrs \
#       --port 31337 -- --resume
#
# Options:
#   --peers-file FILE   initial peers, one multiaddr per line (as written by --addrs-file);
#                       waits up to --wait seconds for it to appear and for a peer in it to
#                       accept TCP connections (a file left by an earlier run may name a
#                       bootstrap that is still starting)
#   --wait SECONDS      how long to wait for --peers-file (default 300)
#   --config FILE       training config (default $OPENDILOCO_CONFIG, else configs/tiny.toml)
#   --run-id ID         swarm run id: only workers with the same id average together
#                       (default $OPENDILOCO_RUN_ID, else the config's)
#   --port PORT         p2p TCP port to listen on (default $OPENDILOCO_P2P_PORT, else 0 = any free port)
#   --listen-ip IP      address to listen on (default 0.0.0.0: all interfaces)
#   --public-ip IP      announce /ip4/IP/tcp/PORT to others (a public IP, or the host's IP in front of
#                       a container); needs a fixed --port
#   --public-port PORT  the port others reach on --public-ip, when a NAT/port mapping changes it
#   --client-mode       make outbound connections only (behind NAT without port forwarding)
#   --identity-path F   persistent peer identity (a stable peer id across restarts)
#   --run-dir DIR       where checkpoints and metrics.jsonl go (default: runs/<run name>/<hostname>)
#   --secret-file FILE  the run's secret (default: $OPENDILOCO_RUN_SECRET, else $OPENDILOCO_RUN_SECRET_FILE,
#                       else [swarm] secret_file of the config); without one the script refuses to start
#   --open-run          join an open run, without a secret: anyone who can reach its workers can join it,
#                       vote on the run's state, serve state to joiners, download the model and stall rounds
#   --dry-run           print the command instead of running it
#
# The script `exec`s `opendiloco train`, so signals (Ctrl-C, docker stop) reach the trainer itself.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "join_swarm.sh: $*" >&2; exit 2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
peers=() peers_file="" wait_s=300 dry_run=0 client_mode=0
config=${OPENDILOCO_CONFIG:-} run_id=${OPENDILOCO_RUN_ID:-} port=${OPENDILOCO_P2P_PORT:-0}
listen_ip=0.0.0.0 public_ip="" public_port="" identity="" run_dir="" secret_file="" open_run=0

while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --peers-file) peers_file=${2:?--peers-file needs a value}; shift 2 ;;
        --wait) wait_s=${2:?--wait needs a value}; shift 2 ;;
        --config) config=${2:?--config needs a value}; shift 2 ;;
        --run-id) run_id=${2:?--run-id needs a value}; shift 2 ;;
        --port) port=${2:?--port needs a value}; shift 2 ;;
        --listen-ip) listen_ip=${2:?--listen-ip needs a value}; shift 2 ;;
        --public-ip) public_ip=${2:?--public-ip needs a value}; shift 2 ;;
        --public-port) public_port=${2:?--public-port needs a value}; shift 2 ;;
        --client-mode) client_mode=1; shift ;;
        --identity-path) identity=${2:?--identity-path needs a value}; shift 2 ;;
        --run-dir) run_dir=${2:?--run-dir needs a value}; shift 2 ;;
        --secret-file) secret_file=${2:?--secret-file needs a value}; shift 2 ;;
        --open-run) open_run=1; shift ;;
        --dry-run) dry_run=1; shift ;;
        --) shift; break ;;
        /*) peers+=("$1"); shift ;;
        *) die "unknown option or not a multiaddr: $1 (see --help)" ;;
    esac
done

case "$port" in ''|*[!0-9]*) die "--port must be a number, got '$port'" ;; esac
[ "$port" -le 65535 ] || die "--port must be <= 65535, got $port"

if [ -z "$config" ]; then
    config="$here/../configs/tiny.toml"
    [ -f "$config" ] || config=/app/configs/tiny.toml
fi
[ -f "$config" ] || die "config $config not found (use --config)"

if command -v opendiloco >/dev/null 2>&1; then
    cmd=(opendiloco)
elif [ -x "$here/../.venv/bin/opendiloco" ]; then
    cmd=("$here/../.venv/bin/opendiloco")
else
    die "opendiloco is not installed (run scripts/setup.sh, or activate its venv)"
fi

# A closed run (the run's secret) or an open one chosen with --open-run; checked before any wait.
membership=()
if [ "$open_run" = 1 ]; then
    [ -z "$secret_file" ] || die "--open-run and --secret-file: a run is either open or closed by its secret"
    for v in OPENDILOCO_RUN_SECRET OPENDILOCO_RUN_SECRET_FILE; do
        [ -z "${!v:-}" ] || die "--open-run, but \$$v is set (a closed run's secret): unset it, or drop --open-run"
    done
    membership=(--swarm.open)
elif [ -n "$secret_file" ]; then
    [ -f "$secret_file" ] && [ -r "$secret_file" ] ||
        die "run secret $secret_file is missing or not readable by this user (uid $(id -u))"
    unset OPENDILOCO_RUN_SECRET  # the file named here wins over a value in the environment
    membership=(--swarm.secret-file "$secret_file")
elif [ -n "${OPENDILOCO_RUN_SECRET_FILE:-}" ] && [ -z "${OPENDILOCO_RUN_SECRET:-}" ]; then
    [ -f "$OPENDILOCO_RUN_SECRET_FILE" ] && [ -r "$OPENDILOCO_RUN_SECRET_FILE" ] ||
        die "run secret $OPENDILOCO_RUN_SECRET_FILE (\$OPENDILOCO_RUN_SECRET_FILE) is missing or not readable by this user (uid $(id -u))"
elif [ -z "${OPENDILOCO_RUN_SECRET:-}" ]; then
    # Neither here nor in the environment: the config (or the options after --) may name one, or open the run.
    resolved=$("${cmd[@]}" train --config "$config" "$@" --print-config 2>&1) || die "$(tail -n 1 <<<"$resolved")"
    sed -n '/^\[swarm\]/,/^\[/p' <<<"$resolved" | grep -Eq '^(secret_file = |open = true$)' ||
        die "no run secret: give the run's secret file with --secret-file FILE or \$OPENDILOCO_RUN_SECRET_FILE" \
            "(make one with \`opendiloco secret FILE\` and copy it to every worker), or join an open run, in which" \
            "anyone who can reach a worker can join, vote on the run's state, serve state to joiners and stall" \
            "rounds, with --open-run"
fi

if [ -n "$peers_file" ]; then
    deadline=$((SECONDS + wait_s))
    until [ -s "$peers_file" ]; do
        [ "$SECONDS" -lt "$deadline" ] || die "no peer address in $peers_file after ${wait_s}s (is the bootstrap running?)"
        sleep 1
    done
    while read -r line; do
        [ -n "$line" ] && peers+=("$line")
    done < "$peers_file"
fi

# 0: one of the peers accepts TCP connections; 1: none does yet; 2: none has a TCP address to try.
tcp_reachable() {
    local p rc=2
    for p in "${peers[@]}"; do
        [[ $p =~ ^/(ip4|ip6|dns4|dns6|dns)/([^/]+)/tcp/([0-9]+)(/|$) ]] || continue
        rc=1
        timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "${BASH_REMATCH[2]}" "${BASH_REMATCH[3]}" 2>/dev/null && return 0
    done
    return "$rc"
}
# A peers file outlives its bootstrap (a restarted compose project keeps the volume): wait, within
# the same --wait, until a peer in it listens, or the trainer would find nobody and stop.
if [ -n "$peers_file" ] && [ "$dry_run" = 0 ]; then
    while :; do
        rc=0
        tcp_reachable || rc=$?
        [ "$rc" = 1 ] || break
        [ -n "${told:-}" ] || { told=1; echo "join_swarm.sh: waiting for a peer in $peers_file to accept connections" >&2; }
        [ "$SECONDS" -lt "$deadline" ] || die "no peer in $peers_file accepts connections after ${wait_s}s (is the bootstrap running?)"
        sleep 1
    done
fi
[ ${#peers[@]} -gt 0 ] || die "give at least one peer address (/ip4/.../tcp/PORT/p2p/12D3KooW...) or --peers-file"
for p in "${peers[@]}"; do
    case "$p" in */p2p/*) ;; *) die "$p has no /p2p/<peer id> part; copy the whole address a peer printed" ;; esac
done

cmd+=(train --config "$config" --swarm.initial-peers "${peers[@]}"
      --swarm.host-maddrs "/ip4/$listen_ip/tcp/$port")
if [ -n "$public_ip" ]; then
    [ "$port" != 0 ] || die "--public-ip needs a fixed --port (the one forwarded to this machine)"
    cmd+=(--swarm.announce-maddrs "/ip4/$public_ip/tcp/${public_port:-$port}")
fi
[ "$client_mode" = 0 ] || cmd+=(--swarm.client-mode)
[ -z "$identity" ] || cmd+=(--swarm.identity-path "$identity")
[ -z "$run_id" ] || cmd+=(--swarm.run-id "$run_id")
[ -z "$run_dir" ] || cmd+=(--run.dir "$run_dir")
cmd+=("${membership[@]}" "$@")

if [ "$dry_run" = 1 ]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
echo "join_swarm.sh: ${cmd[*]}" >&2
exec "${cmd[@]}"
