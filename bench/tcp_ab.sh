#!/usr/bin/env bash
# Two fulcrum binaries (A, B) beside HAProxy and direct, in one run, rounds alternating the
# order of the targets: the setup of bench/tcp.sh (3 nginx backends, `tcp` vserver with
# `source_ip_hash`, HAProxy `mode tcp` from the peers), `wrk -t2 -cCONNS -dDURs` per target,
# keep-alive and `Connection: close`. Prints req/s, p99 and the whole cost per request of each
# proxy (the machine's CPU per request through it minus the same figure direct, in the same
# round, as bench/tcp.sh) per target, and the load average.
# Usage: DUR=10 ROUNDS=3 bench/tcp_ab.sh OLD_BINARY NEW_BINARY   (needs nginx, haproxy, wrk)
. "$(dirname "$0")/lib.sh"
[ $# -eq 2 ] || { echo "usage: $0 FULCRUM_A FULCRUM_B" >&2; exit 2; }
FA=$1; FB=$2
DUR=${DUR:-10}; CONNS=${CONNS:-64}; ROUNDS=${ROUNDS:-2}
B1=${B1:-18081}; HA=${HA:-19000}; PA=${PA:-19100}; PB=${PB:-19200}
tcp_peer_configs
tcp_yaml error "t:$PA" > "$TMP/a.yaml"; tcp_yaml error "t:$PB" > "$TMP/b.yaml"
timeout 1800 nginx -c "$TMP/backends.conf" > "$TMP/backends.log" 2>&1 & PIDS+=($!)
timeout 1800 haproxy -db -f "$TMP/haproxy.cfg" > "$TMP/haproxy.log" 2>&1 & PIDS+=($!)
timeout 1800 "$FA" run --config "$TMP/a.yaml" > "$TMP/a.log" 2>&1 & PIDS+=($!)
timeout 1800 "$FB" run --config "$TMP/b.yaml" > "$TMP/b.log" 2>&1 & PIDS+=($!)
sleep 1
echo "# wrk -t2 -c$CONNS -d${DUR}s; A=$FA B=$FB; $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
  order="direct haproxy A B"; [ $((r % 2)) = 0 ] && order="direct B A haproxy"
  for mode in ka close; do
    hdr=(); [ $mode = close ] && hdr=(-H "Connection: close")
    line="round $r $mode:"
    declare -A HOST=()
    for tgt in $order; do
      case $tgt in direct) port=$B1;; haproxy) port=$HA;; A) port=$PA;; B) port=$PB;; esac
      b0=$(busy_ticks)
      out=$(timeout $((DUR + 30)) wrk -t2 -c"$CONNS" -d"${DUR}s" --latency "${hdr[@]}" "http://127.0.0.1:$port/" 2>&1)
      b1=$(busy_ticks)
      rps=$(awk '/Requests\/sec/{print $2}' <<<"$out"); p99=$(awk '/^ +99%/{print $2}' <<<"$out")
      se=$(grep -o "Socket errors:.*" <<<"$out" | tr -d ' ')
      HOST[$tgt]=$(awk -v b=$((b1 - b0)) -v hz="$(getconf CLK_TCK)" -v n="${rps:-0}" -v d="$DUR" 'BEGIN{
        r = n * d; if (r == 0) r = 1; printf "%.2f", b * 1e6 / hz / r }')
      line="$line $tgt=$rps (p99 $p99${se:+, $se})"
    done
    cost=""
    for tgt in haproxy A B; do
      cost="$cost $tgt $(awk -v t="${HOST[$tgt]}" -v d="${HOST[direct]}" 'BEGIN{printf "%.2f", t - d}')"
    done
    echo "$line; cost us/req:$cost; load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
echo "# end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
