#!/usr/bin/env bash
# Builds the image from this repo's Dockerfile and trains a small swarm in containers:
# a DHT bootstrap and two workers of a closed run (host network, 127.0.0.1; the run secret made by
# the image's own `opendiloco secret`), until the workers have averaged
# together for a few outer steps with equal global hashes; then `opendiloco status` from a
# container, SIGTERM (each worker must checkpoint and exit 0, leaving no process behind), and
# clean-up of everything this script created.
#
#   scripts/container_smoke.sh [options]
#
#   scripts/container_smoke.sh                                    # docker or podman, BASE as in the Dockerfile
#   scripts/container_smoke.sh --make-base --wheels /srv/wheels   # no registry: a debootstrap base
#
# Options:
#   --engine E          docker or podman (default: docker if its engine answers, else podman)
#   --base IMAGE        the BASE build argument; must exist locally (default: the Dockerfile's)
#   --make-base         make the base offline with debootstrap (root; Debian bookworm, whose
#                       python3 is 3.11) and import it, unless it already exists:
#                       localhost/opendiloco-smoke-base:bookworm
#   --mirror URL        Debian mirror for --make-base (default http://deb.debian.org/debian)
#   --image TAG         tag to build (default localhost/opendiloco-smoke:<run tag>)
#   --no-build          use --image as it is (it is then kept)
#   --keep-image        keep the built image (and a base made by --make-base)
#   --wheels DIR        a local wheel folder (e.g. the CPU torch wheel), served to the build on
#                       127.0.0.1 as pip's find-links (default: pip's find-links here, if a folder)
#   --ca-bundle FILE    CA bundle pip uses in the build, as a build secret (default: pip's `cert`
#                       setting here, else $PIP_CERT / $REQUESTS_CA_BUNDLE, if set)
#   --pip-conf FILE     pip configuration for the build, as a build secret (default: one made
#                       from --wheels and --ca-bundle)
#   --no-pip-config     hand the build none of the above (a machine that reaches PyPI directly)
#   --build-arg K=V     passed to the build (repeatable); proxy variables set here are passed too
#   --outer-steps N     outer steps both workers must average together with equal hashes (default 3)
#   --timeout S         limit for each wait: base, build, bootstrap, training, stop (default 900)
#   --results FILE      also write the measured figures as JSON
#   -h, --help
#
# Every wait has a time limit; on any failure the containers' last log lines are printed.
# Exit status: 0 all checks passed; 1 a check failed; 2 a usage or environment error.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "container_smoke.sh: $*" >&2; exit 2; }
fail() { echo "container_smoke.sh: FAILED: $*" >&2; dump_logs; exit 1; }
say() { echo "[$(date -u +%H:%M:%S)] $*"; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
engine="" base="" make_base=0 mirror=http://deb.debian.org/debian image="" build=1 keep_image=0
wheels="" ca_bundle="" pip_conf="" pip_config=1 outer_steps=3 timeout_s=900 results=""
build_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --engine) engine=${2:?--engine needs a value}; shift 2 ;;
        --base) base=${2:?--base needs a value}; shift 2 ;;
        --make-base) make_base=1; shift ;;
        --mirror) mirror=${2:?--mirror needs a value}; shift 2 ;;
        --image) image=${2:?--image needs a value}; shift 2 ;;
        --no-build) build=0; shift ;;
        --keep-image) keep_image=1; shift ;;
        --wheels) wheels=${2:?--wheels needs a value}; shift 2 ;;
        --ca-bundle) ca_bundle=${2:?--ca-bundle needs a value}; shift 2 ;;
        --pip-conf) pip_conf=${2:?--pip-conf needs a value}; shift 2 ;;
        --no-pip-config) pip_config=0; shift ;;
        --build-arg) build_args+=(--build-arg "${2:?--build-arg needs K=V}"); shift 2 ;;
        --outer-steps) outer_steps=${2:?--outer-steps needs a value}; shift 2 ;;
        --timeout) timeout_s=${2:?--timeout needs a value}; shift 2 ;;
        --results) results=${2:?--results needs a value}; shift 2 ;;
        *) die "unknown option: $1 (see --help)" ;;
    esac
done
case "$outer_steps" in ''|*[!0-9]*|0) die "--outer-steps must be a positive number, got '$outer_steps'" ;; esac
case "$timeout_s" in ''|*[!0-9]*|0) die "--timeout must be a positive number of seconds, got '$timeout_s'" ;; esac
[ "$build" = 1 ] || [ -n "$image" ] || die "--no-build needs --image"
[ "$make_base" = 0 ] || [ -z "$base" ] || die "give --base or --make-base, not both"
[ -z "$wheels" ] || [ -d "$wheels" ] || die "--wheels $wheels is not a folder"
[ -z "$ca_bundle" ] || [ -f "$ca_bundle" ] || die "--ca-bundle $ca_bundle is not a file"
[ -z "$pip_conf" ] || [ -f "$pip_conf" ] || die "--pip-conf $pip_conf is not a file"
[ -z "$results" ] || [ -d "$(dirname "$results")" ] || die "--results: folder $(dirname "$results") does not exist"

# --- the engine ------------------------------------------------------------------------------
if [ -z "$engine" ]; then
    if command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then
        engine=docker
    elif command -v podman >/dev/null 2>&1; then
        engine=podman
    else
        die "no container engine: docker's engine does not answer and podman is not installed"
    fi
fi
case "$engine" in
    docker) timeout 20 docker info >/dev/null 2>&1 || die "docker's engine does not answer (docker info)" ;;
    podman) command -v podman >/dev/null 2>&1 || die "podman is not installed" ;;
    *) die "--engine must be docker or podman, got '$engine'" ;;
esac

tag="odl-smoke-$$"
work=$(mktemp -d "${TMPDIR:-/tmp}/$tag.XXXXXX")
label="opendiloco-smoke=$tag"
[ -n "$image" ] || image="localhost/opendiloco-smoke:$tag"
made_image=0 made_base=0 server_pid="" child=""
containers=("$tag-bootstrap" "$tag-worker-a" "$tag-worker-b")
helpers=("$tag-status" "$tag-check" "$tag-mksecret")  # short-lived --rm containers, named so that clean-up finds them
volumes=("$tag-runs" "$tag-swarm" "$tag-identity" "$tag-secret")

e() { "$engine" "$@"; }
# A command with a time limit (timeout(1) ends it, and only it).
within() { local s=$1; shift; timeout --kill-after=10 "$s" "$@"; }
# The same for the long steps, waited for in the background: bash runs a trap only once a
# foreground command has ended, and `wait` lets Ctrl-C / SIGTERM through at once (clean-up ends it).
within_bg() {
    local rc=0
    within "$@" &
    child=$!
    wait "$child" || rc=$?
    child=""
    return "$rc"
}

dump_logs() {
    local c
    for c in "${containers[@]}"; do
        if e container inspect "$c" >/dev/null 2>&1; then
            echo "--- last log lines of $c:" >&2
            e logs --tail 25 "$c" 2>&1 | tr '\r' '\n' | tail -n 25 >&2 || true
        fi
    done
}

cleanup() {
    local rc=$? c i
    trap - EXIT INT TERM
    set +e  # clean up as much as possible, whatever fails
    if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null || true; wait "$child" 2>/dev/null || true; fi
    for c in "${containers[@]}" "${helpers[@]}"; do
        if e container inspect "$c" >/dev/null 2>&1; then
            within 60 "$engine" stop -t 20 "$c" >/dev/null 2>&1 || true
            within 60 "$engine" rm -f -v "$c" >/dev/null 2>&1 || true  # -v: its anonymous volumes too
        fi
    done
    for c in "${volumes[@]}"; do
        e volume inspect "$c" >/dev/null 2>&1 && { e volume rm -f "$c" >/dev/null 2>&1 || true; }
    done
    if [ "$made_image" = 1 ] && { [ "$keep_image" = 0 ] || ! e image inspect "$image" >/dev/null 2>&1; }; then
        e rmi -f "$image" >/dev/null 2>&1
        if [ "$engine" = podman ]; then  # what an interrupted build leaves: its containers, its layers
            for c in $(podman ps -a --external --filter "label=$label" -q 2>/dev/null); do podman rm -f "$c" >/dev/null 2>&1; done
            for c in $(podman images -a --filter "label=$label" -q 2>/dev/null); do podman rmi -f "$c" >/dev/null 2>&1; done
        fi
    fi
    [ "$made_base" = 0 ] || [ "$keep_image" = 1 ] || e rmi -f "$base" >/dev/null 2>&1
    [ -z "$server_pid" ] || kill "$server_pid" 2>/dev/null || true
    # An interrupted debootstrap can leave /proc or /sys mounted in its tree (unmount them, never
    # descend into them), and a process of it may still be writing there for a moment.
    for i in 1 2 3 4 5 6 7 8 9 10; do
        awk -v w="$work/" 'index($2, w) == 1 {print $2}' /proc/mounts 2>/dev/null | sort -r |
            while read -r m; do umount -l "$m" 2>/dev/null; done
        rm -rf --one-file-system "$work" 2>/dev/null && break
        sleep 1
    done
    [ ! -e "$work" ] || echo "container_smoke.sh: could not remove $work" >&2
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

podman_probe() { within 120 podman run --rm --network host --entrypoint /bin/sh "$1" -c true >"$work/probe.log" 2>&1; }

# Podman on some kernels cannot apply its default ulimits, or lacks its default runtime: if a
# trivial container fails, retry with a configuration (for this script's commands only) with no
# default ulimits, runc and cgroupfs.
podman_fallback_conf() {
    local conf="$work/containers.conf"
    {
        echo "[containers]"; echo "default_ulimits = []"
        echo "[engine]"; echo 'cgroup_manager = "cgroupfs"'
        if command -v runc >/dev/null 2>&1; then echo 'runtime = "runc"'; fi
    } >"$conf"
    export CONTAINERS_CONF="$conf"
}

# --- the base ----------------------------------------------------------------------------------
if [ "$build" = 1 ]; then
    if [ "$make_base" = 1 ]; then
        base=localhost/opendiloco-smoke-base:bookworm
        if ! e image inspect "$base" >/dev/null 2>&1; then
            command -v debootstrap >/dev/null 2>&1 || die "--make-base needs debootstrap (apt-get install debootstrap)"
            [ "$(id -u)" = 0 ] || die "--make-base needs root (debootstrap)"
            say "making $base with debootstrap (minbase, bookworm) from $mirror"
            t0=$SECONDS
            within_bg "$timeout_s" debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
                { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
            rm -f "$work"/rootfs/var/cache/apt/archives/*.deb
            made_base=1
            tar -C "$work/rootfs" -c . | within "$timeout_s" "$engine" import - "$base" >/dev/null 2>>"$work/import.log" ||
                die "$engine import of the debootstrap tree failed"
            rm -rf "$work/rootfs"
            say "base made in $((SECONDS - t0))s"
        fi
    elif [ -z "$base" ]; then
        base=$(sed -n 's/^ARG BASE=//p' "$root/Dockerfile" | head -n 1)
    fi
    e image inspect "$base" >/dev/null 2>&1 ||
        die "base image $base is not here (pull it, pass --base IMAGE, or --make-base)"
    probe_image=$base
else
    e image inspect "$image" >/dev/null 2>&1 || die "image $image is not here (drop --no-build to build it)"
    probe_image=$image
fi
if [ "$engine" = podman ] && [ -z "${CONTAINERS_CONF:-}" ] && ! podman_probe "$probe_image"; then
    podman_fallback_conf
    podman_probe "$probe_image" || { cat "$work/probe.log" >&2; die "podman cannot run a container here (above)"; }
    say "podman: a container failed with the default configuration; using no default ulimits, cgroupfs and runc (CONTAINERS_CONF, for this script only)"
fi

# --- the build ---------------------------------------------------------------------------------
pip_setting() { python3 -m pip config get "$1" 2>/dev/null | head -n 1 || true; }
secret_args=()
if [ "$build" = 1 ]; then
    if [ "$pip_config" = 1 ] && [ -z "$pip_conf" ] && command -v python3 >/dev/null 2>&1; then
        if [ -z "$wheels" ]; then
            for w in ${PIP_FIND_LINKS:-} $(pip_setting global.find-links); do
                [ -d "$w" ] && { wheels=$w; break; }
            done
        fi
        if [ -z "$ca_bundle" ]; then
            for c in "$(pip_setting global.cert)" "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}"; do
                [ -n "$c" ] && [ -f "$c" ] && { ca_bundle=$c; break; }
            done
        fi
    fi
    if [ "$pip_config" = 1 ] && [ -z "$pip_conf" ] && { [ -n "$wheels" ] || [ -n "$ca_bundle" ]; }; then
        pip_conf="$work/build-pip.conf"
        echo "[global]" >"$pip_conf"
        if [ -n "$ca_bundle" ]; then echo "cert = /run/secrets/ca_bundle" >>"$pip_conf"; fi
        if [ -n "$wheels" ]; then
            command -v python3 >/dev/null 2>&1 || die "--wheels needs python3 here (it serves the folder to the build)"
            python3 -u -m http.server --bind 127.0.0.1 --directory "$wheels" 0 >"$work/wheels.log" 2>&1 &
            server_pid=$!
            port=""
            for _ in $(seq 1 100); do
                port=$(sed -n 's/.* port \([0-9][0-9]*\).*/\1/p' "$work/wheels.log" | head -n 1)
                [ -n "$port" ] && break
                kill -0 "$server_pid" 2>/dev/null || break
                sleep 0.1
            done
            [ -n "$port" ] || die "could not serve $wheels on 127.0.0.1 (python3 -m http.server)"
            echo "find-links = http://127.0.0.1:$port/" >>"$pip_conf"
            # The torch wheel is in the folder: take only its dependencies from the index.
            torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' "$root/Dockerfile" | head -n 1)
            if compgen -G "$wheels/torch-${torch_version}[+-]*.whl" >/dev/null &&
               ! printf '%s\n' "${build_args[@]}" | grep -q '^TORCH_INDEX_URL='; then
                index=$(pip_setting global.index-url)
                build_args+=(--build-arg "TORCH_INDEX_URL=${index:-https://pypi.org/simple}")
            fi
        fi
    fi
    [ -z "$pip_conf" ] || secret_args+=(--secret "id=pip_conf,src=$pip_conf")
    [ -z "$ca_bundle" ] || [ "$pip_config" = 0 ] || secret_args+=(--secret "id=ca_bundle,src=$ca_bundle")
    for v in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
        [ -z "${!v:-}" ] || build_args+=(--build-arg "$v=${!v}")
    done
    fmt=()
    [ "$engine" = podman ] && fmt=(--format docker)   # keeps HEALTHCHECK and SHELL
    say "building $image from BASE=$base with $engine${wheels:+ (wheels from $wheels)}${ca_bundle:+ (CA bundle $ca_bundle)}"
    t0=$SECONDS
    made_image=1
    if ! DOCKER_BUILDKIT=1 within_bg "$timeout_s" "$engine" build "${fmt[@]}" --network host --label "$label" \
            --build-arg "BASE=$base" "${build_args[@]}" "${secret_args[@]}" -t "$image" "$root" >"$work/build.log" 2>&1; then
        tail -n 30 "$work/build.log" >&2
        fail "the build failed (last lines above)"
    fi
    build_s=$((SECONDS - t0))
    [ -z "$server_pid" ] || { kill "$server_pid" 2>/dev/null || true; server_pid=""; }
    say "built in ${build_s}s"
else
    build_s=null
fi
image_bytes=$(e image inspect --format '{{.Size}}' "$image")
say "image $image: $((image_bytes / 1000000)) MB"

# --- the swarm ---------------------------------------------------------------------------------
for v in "${volumes[@]}"; do e volume create --label "$label" "$v" >/dev/null; done
# Podman runs health checks from systemd timers (absent here): keep the check, run it by hand below.
hc=()
[ "$engine" = docker ] || hc=(--health-interval disable)
common=(--network host --label "$label" "${hc[@]}" -v "$tag-runs:/data/runs" -v "$tag-swarm:/data/swarm")

# A closed run, as every swarm is by default: the image's `opendiloco secret` writes the run secret (mode
# 600) into a volume as the image's user (first mounted on /data/identity, a folder of the image that this
# user owns, so the new volume becomes theirs); the workers and `status` read it, mounted read-only.
within 120 "$engine" run --rm --name "$tag-mksecret" --label "$label" "${hc[@]}" -v "$tag-secret:/data/identity" \
    "$image" secret /data/identity/run_secret >/dev/null 2>>"$work/engine.log" ||
    { tail -n 5 "$work/engine.log" >&2; fail "could not make the run secret"; }
secret_mount=(-v "$tag-secret:/data/secret:ro")
secret_file=/data/secret/run_secret

# Fixed ports, free now, each in its container's $OPENDILOCO_P2P_PORT (what the HEALTHCHECK watches).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
        echo $((20000 + RANDOM % 30000))
}
ports=()
while [ ${#ports[@]} -lt 3 ]; do
    p=$(free_port)
    case " ${ports[*]} " in *" $p "*) ;; *) ports+=("$p") ;; esac
done
say "starting the bootstrap (127.0.0.1:${ports[0]})"
e run -d --name "$tag-bootstrap" --hostname "$tag-bootstrap" "${common[@]}" -e "OPENDILOCO_P2P_PORT=${ports[0]}" \
    -v "$tag-identity:/data/identity" "$image" dht --host-maddrs "/ip4/127.0.0.1/tcp/${ports[0]}" \
    --identity-path /data/identity/bootstrap.key --addrs-file /data/swarm/bootstrap.addrs >/dev/null 2>>"$work/engine.log" ||
    { tail -n 5 "$work/engine.log" >&2; fail "could not start the bootstrap"; }
peer=""
deadline=$((SECONDS + timeout_s))
while [ -z "$peer" ]; do
    [ "$(e inspect -f '{{.State.Running}}' "$tag-bootstrap")" = true ] || fail "the bootstrap exited"
    [ "$SECONDS" -lt "$deadline" ] || fail "no bootstrap address after ${timeout_s}s"
    sleep 1
    peer=$(e exec "$tag-bootstrap" sh -c 'head -n 1 /data/swarm/bootstrap.addrs 2>/dev/null' || true)
done
say "bootstrap: $peer"

# Small rounds (5 inner steps of batch 4) so that a few outer steps come quickly on 2 cores.
t_run=$(date +%s.%N)
i=0
for w in a b; do
    i=$((i + 1))
    e run -d --name "$tag-worker-$w" --hostname "$tag-worker-$w" "${common[@]}" -e "OPENDILOCO_P2P_PORT=${ports[$i]}" \
        "${secret_mount[@]}" --entrypoint join_swarm.sh "$image" --secret-file "$secret_file" \
        --peers-file /data/swarm/bootstrap.addrs --wait 60 --listen-ip 127.0.0.1 --run-id "$tag" \
        --run-dir "/data/runs/worker-$w" -- --optim.local-steps 5 --train.batch-size 4 --train.total-steps 100000 \
        >/dev/null 2>>"$work/engine.log" || { tail -n 5 "$work/engine.log" >&2; fail "could not start worker $w"; }
done
say "workers started; waiting for $outer_steps outer steps averaged by both with equal hashes"

# Reads both workers' metrics.jsonl (in a worker) and prints one line:
#   <outer steps averaged by both, group_size 2, same hash> <first outer_step time> <time of the
#   first one with group_size 2> <hash of the last common step> <outer steps of a> <of b>
progress_py='
import json, pathlib
runs = {}
for w in ("a", "b"):
    p = pathlib.Path("/data/runs/worker-" + w + "/metrics.jsonl")
    recs = []
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line being written
            if r.get("event") == "outer_step":
                recs.append(r)
    runs[w] = recs
times = [r["time"] for recs in runs.values() for r in recs]
grouped = [r["time"] for recs in runs.values() for r in recs if (r.get("group_size") or 0) >= 2]
a = {r["outer_step"]: r for r in runs["a"] if r.get("ok") and (r.get("group_size") or 0) >= 2}
b = {r["outer_step"]: r for r in runs["b"] if r.get("ok") and (r.get("group_size") or 0) >= 2}
same = sorted(s for s in a if s in b and a[s].get("global_hash") and a[s]["global_hash"] == b[s].get("global_hash"))
print(len(same), min(times, default=0), min(grouped, default=0), a[same[-1]]["global_hash"] if same else "-",
      len(runs["a"]), len(runs["b"]))
'
deadline=$((SECONDS + timeout_s))
while :; do
    for w in a b; do
        [ "$(e inspect -f '{{.State.Running}}' "$tag-worker-$w")" = true ] || fail "worker $w exited"
    done
    read -r n_same t_first t_grouped last_hash n_a n_b < <(within 60 "$engine" exec "$tag-worker-a" python -c "$progress_py" || echo "0 0 0 - 0 0")
    [ "$n_same" -ge "$outer_steps" ] && break
    [ "$SECONDS" -lt "$deadline" ] ||
        fail "after ${timeout_s}s: $n_same outer step(s) averaged by both with equal hashes (outer_step records: a $n_a, b $n_b)"
    sleep 3
done
first_s=$(python3 -c "print(round($t_first - $t_run, 1))" 2>/dev/null || echo null)
grouped_s=$(python3 -c "print(round($t_grouped - $t_run, 1))" 2>/dev/null || echo null)
say "OK: $n_same outer steps averaged by both workers (group_size 2), equal global_hash ($last_hash)"
say "run -> first outer step: ${first_s}s; -> first averaged with group_size 2: ${grouped_s}s"

# --- the image's HEALTHCHECK --------------------------------------------------------------------
for c in "${containers[@]}"; do
    if [ "$engine" = podman ]; then
        if out=$(within 120 podman healthcheck run "$c" 2>&1); then
            health=healthy
        else
            case "$out" in
                *"no defined healthcheck"*) health="none (an image built without --format docker has none)" ;;
                *) fail "HEALTHCHECK of $c: ${out:-unhealthy}" ;;
            esac
        fi
    else
        health=$(e inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$c")
    fi
    say "HEALTHCHECK $c: $health"
done

# --- opendiloco status, from a container -------------------------------------------------------
deadline=$((SECONDS + timeout_s))
while :; do
    e rm -f -v "$tag-status" >/dev/null 2>&1 || true  # one a timeout left behind
    status=$(within 120 "$engine" run --rm --name "$tag-status" --network host --label "$label" "${hc[@]}" \
        "${secret_mount[@]}" "$image" status --secret-file "$secret_file" \
        --swarm.initial-peers "$peer" --run-id "$tag" 2>>"$work/status.log" || true)
    last=$(printf '%s\n' "$status" | tail -n 1)
    case "$last" in *"2 live worker(s)"*) break ;; esac
    [ "$SECONDS" -lt "$deadline" ] ||
        { printf '%s\n' "$status" >&2; tail -n 5 "$work/status.log" >&2; fail "opendiloco status did not list 2 live workers"; }
    sleep 3
done
printf '%s\n' "$status"

# --- SIGTERM: each worker checkpoints and exits 0, and no process of it stays ------------------
pids_of() {  # host PIDs of a container's processes (its init and all descendants), where visible
    local p
    p=$(e inspect -f '{{.State.Pid}}' "$1" 2>/dev/null || true)
    [ -n "$p" ] && [ "$p" != 0 ] && [ -d "/proc/$p" ] || return 0
    local todo=("$p") seen=()
    while [ ${#todo[@]} -gt 0 ]; do
        p=${todo[0]}; todo=("${todo[@]:1}"); seen+=("$p")
        for c in $(cat "/proc/$p/task/"*/children 2>/dev/null); do todo+=("$c"); done
    done
    echo "${seen[@]}"
}
procs=$(for w in a b; do pids_of "$tag-worker-$w"; done)
say "SIGTERM to both workers ($(echo "$procs" | wc -w) processes of theirs on the host)"
t0=$(date +%s.%N)
e kill --signal TERM "$tag-worker-a" "$tag-worker-b" >/dev/null
for w in a b; do
    code=$(within "$timeout_s" "$engine" wait "$tag-worker-$w" 2>/dev/null | tail -n 1) ||
        fail "worker $w did not exit within ${timeout_s}s of SIGTERM"
    [ "$code" = 0 ] || fail "worker $w exited with status $code after SIGTERM"
done
stop_s=$(python3 -c "import time; print(round(time.time() - $t0, 1))" 2>/dev/null || echo null)
left=""
for p in $procs; do [ -d "/proc/$p" ] && left="$left $p"; done
[ -z "$left" ] || fail "processes of the workers still alive after they exited:$left"
e kill --signal TERM "$tag-bootstrap" >/dev/null
code=$(within "$timeout_s" "$engine" wait "$tag-bootstrap" 2>/dev/null | tail -n 1) ||
    fail "the bootstrap did not exit within ${timeout_s}s of SIGTERM"
[ "$code" = 0 ] || fail "the bootstrap exited with status $code after SIGTERM"

check_py='
import json, pathlib, sys
for w in ("a", "b"):
    d = pathlib.Path("/data/runs/worker-" + w)
    latest = d / "checkpoints" / "latest"
    if not latest.is_file():
        sys.exit(f"worker {w}: no checkpoints/latest")
    ends = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if "\"end\"" in x]
    if not ends or not ends[-1].get("stopped"):
        sys.exit(f"worker {w}: no end record with stopped=true")
    files = sorted(p.name for p in (d / "checkpoints").glob("*.pt"))
    outer, inner, ckpt = ends[-1]["outer_step"], ends[-1]["inner_step"], latest.read_text().strip()
    print(f"worker {w}: stopped at outer step {outer}, inner step {inner}; checkpoints {files}, latest -> {ckpt}")
'
if ! within 120 "$engine" run --rm --name "$tag-check" --label "$label" "${hc[@]}" -v "$tag-runs:/data/runs:ro" --entrypoint python "$image" \
        -c "$check_py" >"$work/check.log" 2>"$work/check.err"; then
    cat "$work/check.log" "$work/check.err" >&2
    fail "checkpoints after SIGTERM"
fi
cat "$work/check.log"
say "OK: both workers exited 0 on SIGTERM within ${stop_s}s with a checkpoint; no process left; bootstrap exited 0"

if [ -n "$results" ]; then
    cat >"$results" <<EOF
{"engine": "$engine", "base": "$base", "image_bytes": $image_bytes, "build_s": $build_s,
 "run_to_first_outer_step_s": $first_s, "run_to_first_group_outer_step_s": $grouped_s,
 "outer_steps_averaged": $n_same, "global_hash": "$last_hash", "stop_s": $stop_s}
EOF
fi
say "container smoke test passed"
