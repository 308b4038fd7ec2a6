#!/usr/bin/env bash
# System calls per connection of fulcrum's `tcp` vserver in `Connection: close` mode (one
# connection per request): for each fulcrum binary given, the setup of bench/tcp.sh (3 nginx
# backends, `source_ip_hash`, user-space relay), `wrk -t2 -cCONNS -dDUR` with
# `Connection: close`, and `perf stat` counting fulcrum's system calls meanwhile: all of them
# (raw_syscalls:sys_enter) and `write` alone (fulcrum sends with send/sendto; its writes are
# wake-ups of a worker's runtime through its eventfd). Rounds alternate the binaries.
# Usage: DUR=8 ROUNDS=2 bench/tcp_syscalls.sh FULCRUM...   (needs nginx, wrk, perf)
. "$(dirname "$0")/lib.sh"
[ $# -ge 1 ] || { echo "usage: $0 FULCRUM..." >&2; exit 2; }
DUR=${DUR:-8}; CONNS=${CONNS:-64}; ROUNDS=${ROUNDS:-2}
B1=${B1:-18081}; HA=${HA:-19000}; FU=${FU:-19100}
tcp_peer_configs
tcp_yaml warn "t:$FU" > "$TMP/tcp.yaml"
timeout 1800 nginx -c "$TMP/backends.conf" > "$TMP/backends.log" 2>&1 & PIDS+=($!)
sleep 1
echo "# close mode, wrk -t2 -c$CONNS -d${DUR}s; $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
  bins=("$@"); [ $((r % 2)) = 0 ] && bins=($(printf '%s\n' "$@" | tac))
  for bin in "${bins[@]}"; do
    FUL=$bin start_fulcrum "$TMP/fulcrum.log" --config "$TMP/tcp.yaml"
    sleep 0.5
    # fulcrum's system calls for exactly as long as wrk runs.
    out=$(timeout $((DUR + 30)) perf stat -x, -o "$TMP/perf.out" -p "$FPID" \
      -e raw_syscalls:sys_enter,syscalls:sys_enter_write -- \
      wrk -t2 -c"$CONNS" -d"${DUR}s" -H "Connection: close" "http://127.0.0.1:$FU/" 2>&1)
    stop_fulcrum
    n=$(awk '/requests in/{print $1}' <<<"$out")
    all=$(awk -F, '/raw_syscalls:sys_enter/{print $1}' "$TMP/perf.out")
    writes=$(awk -F, '/syscalls:sys_enter_write/{print $1}' "$TMP/perf.out")
    awk -v b="$bin" -v r="$r" -v n="$n" -v a="$all" -v w="$writes" 'BEGIN{
      printf "round %d %s: %d connections, %.2f system calls per connection, %.3f writes per connection\n", r, b, n, a / n, w / n }'
  done
done
