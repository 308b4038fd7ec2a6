# Prelude shared by the bench/*.sh scripts; sourced, not run:
#   . "$(dirname "$0")/lib.sh"
# Sets ROOT (this crate), PEERS (the peers' configs and tools: $PEERS if set and present, else
# ../shared/bench/peers beside the crate, else /work/shared/bench/peers), TMP (a fresh
# directory, removed on exit) and PIDS (the processes the script started: add each with
# `PIDS+=($!)`). cleanup sends them TERM, waits (at most 3 s) until they have ended, KILLs
# what is left and empties PIDS: it runs on exit (INT and TERM exit with 130 through the same
# trap) and a script may call it between runs.
# Process helpers: child_of PID (a timeout wrapper's command), wait_port PORT [u|t] (until
# something listens), build_fulcrum (release build of fulcrum and fulcrum-load, sets FUL and
# LOAD), start_fulcrum LOG ARGS (fulcrum run under timeout; FPID) and stop_fulcrum,
# wait_ready FILE (a load generator's ready= line).
# Measures: rss PID (VmRSS, KiB), settled PID (RSS once stable), busy_ticks (CPU ticks the
# machine spent busy), tree_ticks PID... (CPU ticks of processes and their descendants),
# rcvbuf_errors (UDP receive-buffer overflows, whole machine), col FILE NAME (a column of a
# SIPp statistics file).
# Peers: tcp_peer_configs (the peers' nginx backends and HAProxy moved to ports B1..B1+2 and
# HA, written to $TMP/backends.conf and $TMP/haproxy.cfg), tcp_yaml (a fulcrum config in front
# of those backends), kamailio_head (the global part of
# the Kamailio configs the SIP comparisons generate).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS=${PEERS:-$ROOT/../shared/bench/peers}
[ -d "$PEERS" ] || PEERS=/work/shared/bench/peers
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  local p i alive
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for i in $(seq 1 30); do
    alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  PIDS=()
}
trap 'cleanup; rm -rf "$TMP"' EXIT
trap 'exit 130' INT TERM

# child_of PID: the PID of the first child of PID (a timeout wrapper's command), waiting at
# most 5 s; fails if there is none.
child_of() {
  local i c
  for i in $(seq 1 100); do c=$(pgrep -P "$1" | head -1); [ -n "$c" ] && { echo "$c"; return 0; }; sleep 0.05; done
  return 1
}
# wait_port PORT [u|t]: poll (at most 10 s) until something listens on UDP (u, the default)
# or TCP (t) port PORT of any address.
wait_port() {
  local i proto=${2:-u}
  for i in $(seq 1 100); do
    ss -H"${proto}"lnp "sport = :$1" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  echo "nothing bound $([ "$proto" = t ] && echo tcp || echo udp) port $1" >&2; return 1
}

# FULCRUM=PATH measures another fulcrum binary (an A/B of two builds) with this checkout's
# load generator.
build_fulcrum() {
  (cd "$ROOT" && cargo build --release -q --bin fulcrum --bin fulcrum-load) || exit 1
  local out=${CARGO_TARGET_DIR:-$ROOT/target}/release
  FUL=${FULCRUM:-$out/fulcrum}; LOAD=$out/fulcrum-load
}

tcp_peer_configs() {
  local backends="s/127.0.0.1:8081/127.0.0.1:$B1/; s/127.0.0.1:8082/127.0.0.1:$((B1 + 1))/; s/127.0.0.1:8083/127.0.0.1:$((B1 + 2))/"
  sed -e "$backends; s#/tmp/peers-nginx-backends#$TMP/backends#g" "$PEERS/nginx/nginx-backends.conf" > "$TMP/backends.conf"
  sed -e "s/127.0.0.1:9000/127.0.0.1:$HA/; $backends; s#/tmp/peers-haproxy#$TMP/haproxy#g" "$PEERS/haproxy/haproxy.cfg" > "$TMP/haproxy.cfg"
}

# tcp_yaml LEVEL NAME:PORT[:FIELDS]...: a fulcrum config (log level LEVEL, no admin API) in
# front of the three backends of tcp_peer_configs, one `tcp` vserver per argument on
# 127.0.0.1:PORT with `source_ip_hash` and FIELDS (e.g. `max_per_source: off`) added.
tcp_yaml() {
  local level=$1 v name port fields; shift
  cat <<YAML
admin: { listen: null }
logging: { level: $level }
services:
  - { name: b1, address: 127.0.0.1:$B1, protocol: tcp }
  - { name: b2, address: 127.0.0.1:$((B1 + 1)), protocol: tcp }
  - { name: b3, address: 127.0.0.1:$((B1 + 2)), protocol: tcp }
vservers:
YAML
  for v in "$@"; do
    IFS=: read -r name port fields <<<"$v"
    echo "  - { name: $name, protocol: tcp, bind: [127.0.0.1:$port], method: source_ip_hash, max_sessions: 100000,${fields:+ $fields,} services: [b1, b2, b3] }"
  done
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
  local log=$1 w; shift
  timeout -s KILL 900 "$FUL" run "$@" > "$log" 2>&1 & w=$!; PIDS+=($w)
  FPID=$(child_of "$w") || { echo "fulcrum did not start (log: $log)" >&2; exit 1; }
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
# thread_ticks PID COMM: "utime stime" (clock ticks) of PID's threads named COMM
thread_ticks() {
  cat /proc/"$1"/task/*/stat 2>/dev/null | awk -v want="($2)" '$2==want{u+=$14; s+=$15} END{print u+0, s+0}'
}
# system-wide UDP receive-buffer overflows (datagrams dropped by the kernel, any socket)
rcvbuf_errors() { awk '/^Udp:/{if(!h){for(i=1;i<=NF;i++) c[$i]=i; h=1} else print $c["RcvbufErrors"]}' /proc/net/snmp; }
# col FILE NAME: column NAME (by header name) of the last line of SIPp statistics file FILE
col() {
  awk -F';' -v name="$2" 'NR==1{for(i=1;i<=NF;i++) if($i==name) c=i; next} NF{last=$0}
    END{split(last, a, ";"); print (c ? a[c] + 0 : "NA")}' "$1"
}

# stop_proxy: SIGTERM the proxy PROXY_PID, SIGKILL after 5 s, reap the `timeout` wrapper
# PROXY_WRAP that started it (when a script keeps one), and forget both.
stop_proxy() {
  [ -n "$PROXY_PID" ] && kill -TERM "$PROXY_PID" 2>/dev/null
  local i; for i in $(seq 1 50); do kill -0 "$PROXY_PID" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$PROXY_PID" 2>/dev/null
  [ -n "${PROXY_WRAP:-}" ] && wait "$PROXY_WRAP" 2>/dev/null
  PROXY_PID=""; PROXY_WRAP=""
}

# wait_lines FILE N PATTERN: wait (bounded, 10 s) until FILE has at least N lines matching
# PATTERN.
wait_lines() {
  local i c
  for i in $(seq 1 100); do
    c=$(grep -c -- "$3" "$1" 2>/dev/null)
    [ "${c:-0}" -ge "$2" ] && return 0
    sleep 0.1
  done
  echo "no $2 x '$3' in $1" >&2; return 1
}

# print_ladder TITLE: each proxy of PROXIES with its highest clean rate (the MAX array, over
# the ladder RATES), and fulcrum's over Kamailio's when both ran.
print_ladder() {
  local proxy last=${RATES##* } note
  echo "== $1 =="
  for proxy in $PROXIES; do
    note=""; [ "${MAX[$proxy]}" = "$last" ] && note=" (cap of the ladder: did not fail)"
    echo "$proxy: ${MAX[$proxy]} calls/s$note"
  done
  if [ -n "${MAX[fulcrum]:-}" ] && [ -n "${MAX[kamailio]:-}" ] && [ "${MAX[kamailio]}" != 0 ]; then
    echo "ratio fulcrum/kamailio: $(awk -v a="${MAX[fulcrum]}" -v b="${MAX[kamailio]}" 'BEGIN{printf "%.2f", a/b}')"
  fi
}

# kamailio_head COMMENT CHILDREN LISTEN DISABLE_TCP [MAXBUFFER]: the global part of a generated
# Kamailio config (no logging to syslog, no DNS, CHILDREN workers on LISTEN), which the script
# follows with its modules and request_route.
kamailio_head() {
  echo "#!KAMAILIO"
  echo "# $1"
  printf '%s\n' "debug=0" "log_stderror=yes" "memdbg=5" "memlog=5" "fork=yes" "children=$2" \
    "listen=$3" "disable_tcp=$4" "auto_aliases=no" "dns=no" "rev_dns=no" "use_dns_cache=no"
  [ -n "${5:-}" ] && echo "maxbuffer=$5"
  echo 'mpath="/usr/lib/x86_64-linux-gnu/kamailio/modules/"'
}
