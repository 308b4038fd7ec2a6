# Prelude shared by the bench/*.sh peer comparisons (idle, udp, tcp, tcp_ab); sourced, not run:
#   . "$(dirname "$0")/lib.sh"
# Sets ROOT (this crate), PEERS (the peers' configs and tools: $PEERS if set and present, else
# ../shared/bench/peers beside the crate, else /work/shared/bench/peers), TMP (a fresh
# directory, removed on exit) and PIDS (the processes the script started: add each with
# `PIDS+=($!)`). On exit they get TERM, then KILL 0.3 s later; INT and TERM exit with 130
# through the same trap. Defines build_fulcrum (release build of fulcrum and fulcrum-load,
# sets FUL and LOAD), tcp_peer_configs (the peers' nginx backends and HAProxy moved to ports
# B1..B1+2 and HA, written to $TMP/backends.conf and $TMP/haproxy.cfg), start_fulcrum LOG
# ARGS (fulcrum run under timeout; FPID) and stop_fulcrum, rss PID (VmRSS, KiB), settled PID
# (RSS once stable), wait_ready FILE,
# busy_ticks (CPU ticks the machine spent busy) and tree_ticks PID... (CPU ticks of processes
# and their descendants).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/bench/peers}
[ -d "$PEERS" ] || PEERS=/work/shared/bench/peers
TMP=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done; sleep 0.3; for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done; rm -rf "$TMP"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# FULCRUM=PATH measures another fulcrum binary (an A/B of two builds) with this checkout's
# load generator.
build_fulcrum() {
  (cd "$ROOT" && cargo build --release -q --bin fulcrum --bin fulcrum-load) || exit 1
  FUL=${FULCRUM:-$ROOT/target/release/fulcrum}; LOAD=$ROOT/target/release/fulcrum-load
}

tcp_peer_configs() {
  local backends="s/127.0.0.1:8081/127.0.0.1:$B1/; s/127.0.0.1:8082/127.0.0.1:$((B1 + 1))/; s/127.0.0.1:8083/127.0.0.1:$((B1 + 2))/"
  sed -e "$backends; s#/tmp/peers-nginx-backends#$TMP/backends#g" "$PEERS/nginx/nginx-backends.conf" > "$TMP/backends.conf"
  sed -e "s/127.0.0.1:9000/127.0.0.1:$HA/; $backends; s#/tmp/peers-haproxy#$TMP/haproxy#g" "$PEERS/haproxy/haproxy.cfg" > "$TMP/haproxy.cfg"
}

rss() { awk '/^VmRSS/{print $2}' "/proc/$1/status"; }
# settled PID: its RSS once it has stopped growing (two equal samples 0.2 s apart, at most 10 s).
settled() { local prev=0 r; for _ in $(seq 1 50); do r=$(rss "$1"); [ "$r" = "$prev" ] && break; prev=$r; sleep 0.2; done; echo "$r"; }
# wait_ready FILE [TENTHS]: until a load generator's output FILE says ready= (at most 30 s).
wait_ready() { for _ in $(seq 1 "${2:-300}"); do grep -q ready= "$1" && break; sleep 0.1; done; }

# start_fulcrum LOG ARGS...: `fulcrum run ARGS` in the background under `timeout` (bounded
# in time even if the exit trap never runs), output in LOG; sets FPID to fulcrum's own PID
# (the wrapper's child), whose RSS and CPU ticks the scripts read.
start_fulcrum() {
  local log=$1 w i; shift
  timeout -s KILL 900 "$FUL" run "$@" > "$log" 2>&1 & w=$!; PIDS+=($w)
  FPID=
  for i in $(seq 1 100); do FPID=$(pgrep -P "$w" | head -1); [ -n "$FPID" ] && break; sleep 0.05; done
  [ -n "$FPID" ] || { echo "fulcrum did not start (log: $log)" >&2; exit 1; }
  PIDS+=($FPID)
}
# stop_fulcrum [SIGNAL]: SIGTERM (or SIGNAL) to $FPID, then wait (at most 10 s) until it has
# exited (it is the wrapper's child, not this shell's: `wait` cannot).
stop_fulcrum() {
  local i
  kill "-${1:-TERM}" "$FPID" 2>/dev/null
  for i in $(seq 1 200); do kill -0 "$FPID" 2>/dev/null || return 0; sleep 0.05; done
}

# CPU accounting (clock ticks): busy ticks of the whole machine, and utime + stime of processes
# with their descendants (the timeout wrappers' children included).
busy_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
tree_ticks() {
  local t=0 p c
  for p in "$@"; do
    [ -r "/proc/$p/stat" ] && t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
    for c in $(pgrep -P "$p" 2>/dev/null); do t=$((t + $(tree_ticks "$c"))); done
  done
  echo "$t"
}
